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


def _load_in_place(path: str) -> dict:
    """Which parameters of a TP=2 ``load_hf(in_place=True)`` lie in the file's mapping, and which differ from a
    copying load's."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf

    parallel.initialize(tensor_model_parallel_size=2)
    copied = dict(load_hf(path)[0].named_parameters())
    mapped = load_hf(path, in_place=True)
    file_pages = _file_mappings(os.path.join(path, "model.safetensors"))
    in_file = {name: any(start <= p.data_ptr() < end for start, end in file_pages)
               for name, p in mapped[0].named_parameters()}
    unequal = [name for name, p in mapped[0].named_parameters() if not torch.equal(p, copied[name])]
    parallel.destroy()
    return dict(in_file=in_file, unequal=unequal)


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """The address ranges this process maps ``path`` at (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == os.path.realpath(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


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


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_in_place_load_maps_the_file_where_it_stores_a_shard_as_it_is(tmp_path):
    """``load_hf(in_place=True)`` (the teacher's load): at TP=2 the vocabulary-parallel embedding and output-layer
    shards (rows of the file's tensors) and the replicated norms are the file's pages; the fused QKV and fc1 and the
    row-parallel slices (columns: not contiguous in the file) are copies; every value equals the copying load's."""
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama", seed=4)
    for result in run_distributed(_load_in_place, 2, args=(path,), timeout=600):
        assert result["unequal"] == []
        in_file = result["in_file"]
        for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
            assert in_file[name], name
        fused = [name for name in in_file if "linear_qkv.weight" in name or "linear_fc1.weight" in name
                 or "linear_proj.weight" in name or "linear_fc2.weight" in name]
        assert fused and not any(in_file[name] for name in fused), [name for name in fused if in_file[name]]
