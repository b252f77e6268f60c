"""Loading a few-hundred-MB checkpoint at TP=2 never materialises the whole model on one rank.

Measure: a thread samples the process's anonymous resident memory (``RssAnon`` in /proc/self/status,
every 0.5 ms) during ``load_hf``; the peak minus the value before is what loading allocated. File pages
of the memory-mapped safetensors are not anonymous, so reading slices does not count, but every tensor
made from them does. Bound: the rank's own shard (its parameters) plus twice the largest HF tensor
(one parameter's slices and their fused copy exist at once while it is copied in) plus 32 MB for
allocator and Megatron bookkeeping. The test checks that this bound is below the full model, so a
loader that materialised the model would fail, and a control run of the same meter around a naive
full read (every tensor of the file copied into memory) shows that the meter does see one.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import LARGE_LLAMA, make_tiny_checkpoint
from megatron_gkd.testing.memory import AnonPeak

pytestmark = pytest.mark.distributed

MARGIN_BYTES = 32 * 2**20


def _measure_load(path: str) -> dict:
    import gc

    from safetensors.torch import load_file

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf

    parallel.initialize(tensor_model_parallel_size=2)
    gc.collect()
    with AnonPeak() as load:
        chunks = load_hf(path)
    shard_bytes = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
    with AnonPeak() as control:
        # A naive loader: every tensor of the checkpoint in memory (load_file alone maps the file
        # without copying, hence the clone).
        full = {name: tensor.clone() for name, tensor in load_file(os.path.join(path, "model.safetensors")).items()}
    del full
    parallel.destroy()
    return dict(load=load.increase, shard=shard_bytes, control=control.increase)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_tp2_load_stays_within_one_shard(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "large", **LARGE_LLAMA)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as handle:
        sizes = [handle.get_slice(name) for name in handle.keys()]
        sizes = [torch.Size(s.get_shape()).numel() * 4 for s in sizes]
    full_bytes, largest = sum(sizes), max(sizes)
    assert full_bytes > 300 * 2**20

    for rank, result in enumerate(run_distributed(_measure_load, 2, args=(path,), timeout=600)):
        bound = result["shard"] + 2 * largest + MARGIN_BYTES
        mb = {key: f"{value / 2**20:.0f} MB" for key, value in result.items()}
        assert bound < 0.8 * full_bytes, f"test model too small to tell a shard from the model: {mb}"
        assert result["load"] < bound, f"rank {rank} allocated {mb['load']} loading (bound {bound / 2**20:.0f} MB): {mb}"
        assert result["control"] > 0.9 * full_bytes, f"the meter missed a full materialisation: {mb}"
