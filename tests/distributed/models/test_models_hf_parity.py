"""HF checkpoints through ``load_hf`` give transformers' logits, and ``save_hf`` gives them back bit for bit.

One spawn per world size; inside it the layouts of that size run one after the other (parallel state
re-initialised), each loading every architecture, running a forward through Megatron's schedule and
saving the model back with ``save_hf``. The parent compares the logits with ``transformers`` (fp32,
1e-4) and every saved tensor with the original checkpoint (bit for bit, same dtype), and loads one
saved checkpoint with ``transformers``.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import hf_logits, make_tiny_checkpoint, megatron_logits

pytestmark = pytest.mark.distributed

DENSE = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MOE = ["Qwen3MoeForCausalLM"]
ARCHITECTURES = DENSE + MOE

TP2 = dict(tensor_model_parallel_size=2)
TP2_PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
EP2 = dict(expert_model_parallel_size=2)
TP2_EP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)
PP2_VPP2 = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)

# world size -> [(layout name, layout, architectures)]. "tp1" runs as two data-parallel replicas: each
# rank holds a whole TP=1 model, and one spawn is saved.
LAYOUTS = {
    2: [
        ("tp1", {}, ARCHITECTURES),
        ("tp2", TP2, ARCHITECTURES),
        ("ep2", EP2, MOE),
        ("pp2vpp2", PP2_VPP2, ["LlamaForCausalLM", *MOE]),
    ],
    4: [("tp2pp2", TP2_PP2, ARCHITECTURES), ("tp2ep2", TP2_EP2, MOE)],
}
TOLERANCE = 1e-4


def _load_forward_save(layouts, checkpoints, tokens, out_root):
    """Rank body: for each layout and architecture, logits (last stage) and a save_hf directory."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, save_hf

    results = []
    for layout_name, layout, architectures in layouts:
        parallel.initialize(**layout)
        for arch in architectures:
            chunks = load_hf(checkpoints[arch])
            logits = megatron_logits(chunks, tokens)
            out = os.path.join(out_root, f"{layout_name}-{arch}")
            save_hf(chunks, out)
            results.append((layout_name, arch, logits, out))
        parallel.destroy()
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    paths = {arch: make_tiny_checkpoint(arch, root / arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}
    references = {arch: hf_logits(path, tokens) for arch, path in paths.items()}
    return paths, tokens, references


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """world size -> every rank's results, computed once per world size."""
    paths, tokens, _ = checkpoints
    cache = {}

    def run(world_size):
        if world_size not in cache:
            out_root = str(tmp_path_factory.mktemp(f"saved-w{world_size}"))
            cache[world_size] = run_distributed(
                _load_forward_save, world_size, args=(LAYOUTS[world_size], paths, tokens, out_root), timeout=600
            )
        return cache[world_size]

    return run


def _read_all(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_logits_match_transformers(world_size, checkpoints, runs):
    _, _, references = checkpoints
    seen = set()
    for rank_results in runs(world_size):
        for layout_name, arch, logits, _ in rank_results:
            if logits is None:
                continue
            seen.add((layout_name, arch))
            error = (logits - references[arch]).abs().max().item()
            assert error < TOLERANCE, f"{arch} at {layout_name}: max |logit error| {error:.2e}"
    expected = {(name, arch) for name, _, archs in LAYOUTS[world_size] for arch in archs}
    assert seen == expected


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(world_size, checkpoints, runs):
    paths, _, _ = checkpoints
    (rank0, *_) = runs(world_size)
    assert rank0, "no layout ran"
    for layout_name, arch, _, out in rank0:
        original, saved = _read_all(paths[arch]), _read_all(out)
        assert sorted(saved) == sorted(original), f"{arch} at {layout_name}: tensor names differ"
        for name, tensor in original.items():
            assert saved[name].dtype == tensor.dtype, f"{arch} at {layout_name}: {name} dtype"
            assert torch.equal(saved[name], tensor), f"{arch} at {layout_name}: {name} differs"


def test_saved_checkpoint_loads_in_transformers(checkpoints, runs):
    """The tp2pp2 export (files from several ranks + index) is a checkpoint ``transformers`` reads."""
    _, tokens, references = checkpoints
    for layout_name, arch, _, out in runs(4)[0]:
        if layout_name == "tp2pp2":
            assert os.path.isfile(os.path.join(out, "config.json"))
            assert torch.allclose(hf_logits(out, tokens), references[arch], atol=0, rtol=0), arch
