"""HF checkpoints through ``load_hf`` give transformers' logits, and ``save_hf`` gives them back bit for bit.

One spawn per world size; inside it the layouts of that size run one after the other (parallel state
re-initialised), each loading every architecture, running a forward through Megatron's schedule and
saving the model back with ``save_hf``. The parent compares the logits with ``transformers`` (fp32,
1e-4) and every saved tensor with the original checkpoint (bit for bit, same dtype), and loads one
saved checkpoint with ``transformers``. The Qwen3-MoE checkpoint is sharded (index file); a bfloat16
Qwen3 checkpoint is loaded in bfloat16 and checked for the round trip only.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import hf_logits, make_tiny_checkpoint, megatron_logits, read_safetensors_dir

pytestmark = pytest.mark.distributed

DENSE = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MOE = ["Qwen3MoeForCausalLM"]
ARCHITECTURES = DENSE + MOE
BF16 = "Qwen3ForCausalLM-bf16"
# Qwen2-MoE-style routing (softmax over all experts, no renormalisation of the top k) on every other layer.
MOE_VARIANT = "Qwen3MoeForCausalLM-unnormalised"

# case -> (architecture, dtype, make_tiny_checkpoint overrides)
CASES = {
    **{arch: (arch, torch.float32, {}) for arch in DENSE},
    # Sharded into several files with an index.
    "Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", torch.float32, {"max_shard_size": "200KB"}),
    MOE_VARIANT: ("Qwen3MoeForCausalLM", torch.float32, {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}),
    # Round trip only: bfloat16 logits are not comparable at 1e-4.
    BF16: ("Qwen3ForCausalLM", torch.bfloat16, {}),
}

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
        ("tp2", TP2, [*ARCHITECTURES, BF16]),
        ("ep2", EP2, [*MOE, MOE_VARIANT]),
        ("pp2vpp2", PP2_VPP2, ["LlamaForCausalLM", *MOE]),
    ],
    4: [("tp2pp2", TP2_PP2, ARCHITECTURES), ("tp2ep2", TP2_EP2, MOE)],
}
TOLERANCE = 1e-4


def _load_forward_save(layouts, cases, tokens, out_root):
    """Rank body: for each layout and case (name -> (path, dtype)), logits (last stage) and a save_hf directory."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, save_hf

    results = []
    for layout_name, layout, architectures in layouts:
        parallel.initialize(**layout)
        for arch in architectures:
            path, dtype = cases[arch]
            chunks = load_hf(path, dtype=dtype)
            logits = megatron_logits(chunks, tokens) if dtype == torch.float32 else None
            out = os.path.join(out_root, f"{layout_name}-{arch}")
            save_hf(chunks, out)
            results.append((layout_name, arch, logits, out))
        parallel.destroy()
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    paths = {
        case: make_tiny_checkpoint(arch, root / case, seed=i, dtype=dtype, **overrides)
        for i, (case, (arch, dtype, overrides)) in enumerate(CASES.items())
    }
    assert os.path.isfile(os.path.join(paths["Qwen3MoeForCausalLM"], "model.safetensors.index.json"))
    # A tokenizer file that save_hf must carry over from the source directory.
    (root / "LlamaForCausalLM" / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    references = {case: hf_logits(paths[case], tokens) for case, (_, dtype, _) in CASES.items() if dtype == torch.float32}
    return paths, tokens, references


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """world size -> every rank's results, computed once per world size."""
    paths, tokens, _ = checkpoints
    cache = {}

    def run(world_size):
        if world_size not in cache:
            out_root = str(tmp_path_factory.mktemp(f"saved-w{world_size}"))
            cases = {case: (paths[case], dtype) for case, (_, dtype, _) in CASES.items()}
            cache[world_size] = run_distributed(
                _load_forward_save, world_size, args=(LAYOUTS[world_size], cases, tokens, out_root), timeout=600
            )
        return cache[world_size]

    return run


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
    expected = {(name, case) for name, _, cases in LAYOUTS[world_size] for case in cases if case in references}
    assert seen == expected


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(world_size, checkpoints, runs):
    paths, _, _ = checkpoints
    (rank0, *_) = runs(world_size)
    assert rank0, "no layout ran"
    for layout_name, arch, _, out in rank0:
        original, saved = read_safetensors_dir(paths[arch]), read_safetensors_dir(out)
        for name in os.listdir(paths[arch]):
            if name.startswith("tokenizer"):
                with open(os.path.join(paths[arch], name)) as a, open(os.path.join(out, name)) as b:
                    assert a.read() == b.read(), f"{arch} at {layout_name}: {name} not copied"
        assert sorted(saved) == sorted(original), f"{arch} at {layout_name}: tensor names differ"
        for name, tensor in original.items():
            assert saved[name].dtype == tensor.dtype, f"{arch} at {layout_name}: {name} dtype"
            assert torch.equal(saved[name], tensor), f"{arch} at {layout_name}: {name} differs"


def test_saved_checkpoint_loads_in_transformers(checkpoints, runs):
    """The tp2pp2 export (files from several ranks + index) is a checkpoint ``transformers`` reads."""
    _, tokens, references = checkpoints
    for layout_name, arch, _, out in runs(4)[0]:
        if layout_name == "tp2pp2" and arch in references:
            assert os.path.isfile(os.path.join(out, "config.json"))
            assert torch.allclose(hf_logits(out, tokens), references[arch], atol=0, rtol=0), arch
