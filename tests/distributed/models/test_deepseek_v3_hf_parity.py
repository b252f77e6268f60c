"""DeepSeek-V3 through ``load_hf`` gives transformers' logits, and ``save_hf`` gives the checkpoint back.

Two tiny random checkpoints built by ``transformers``: YaRN RoPE with a low-rank query and
group-limited routing (DeepSeek-V3's own settings, scaled down), and plain RoPE with a full-rank query
(``q_lora_rank=None``, DeepSeek-V2-Lite style) and ungrouped routing. Every parameter and the router's
score-correction bias are random (zeros would hide mapping mistakes). Layouts: TP=1, TP=2, EP=2 in one
2-process spawn; TP=2 x EP=2 and TP=2 x PP=2 on 4 processes (slow).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import TINY_CONFIGS, hf_logits, megatron_logits, read_safetensors_dir

pytestmark = pytest.mark.distributed

YARN_LOW_RANK_Q = TINY_CONFIGS["DeepseekV3ForCausalLM"]
ROPE_FULL_RANK_Q = dict(
    YARN_LOW_RANK_Q,
    q_lora_rank=None,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    routed_scaling_factor=1.0,
    first_k_dense_replace=2,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
VARIANTS = {"yarn-q_lora": YARN_LOW_RANK_Q, "rope-full_q": ROPE_FULL_RANK_Q}

LAYOUTS = {
    2: [("tp1", {}), ("tp2", dict(tensor_model_parallel_size=2)), ("ep2", dict(expert_model_parallel_size=2))],
    4: [
        ("tp2ep2", dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)),
        ("tp2pp2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ],
}
TOLERANCE = 1e-4


def _make_checkpoint(config: dict, path, seed: int) -> str:
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for name, tensor in tensors.items():
            noise = torch.randn(tensor.shape, generator=generator) * 0.05
            tensor.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(os.fspath(path))
    return os.fspath(path)


def _load_forward_save(layouts, checkpoints, tokens, out_root):
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, save_hf

    results = []
    for layout_name, layout in layouts:
        parallel.initialize(**layout)
        try:
            for variant, path in checkpoints.items():
                chunks = load_hf(path)
                logits = megatron_logits(chunks, tokens)
                out = os.path.join(out_root, f"{layout_name}-{variant}")
                save_hf(chunks, out)
                results.append((layout_name, variant, logits, out))
        finally:
            parallel.destroy()
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(11))
    paths = {name: _make_checkpoint(config, root / name, seed=i) for i, (name, config) in enumerate(VARIANTS.items())}
    references = {name: hf_logits(path, tokens) for name, path in paths.items()}
    return paths, tokens, references


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    paths, tokens, _ = checkpoints
    cache = {}

    def run(world_size):
        if world_size not in cache:
            out_root = str(tmp_path_factory.mktemp(f"deepseek_v3-saved-w{world_size}"))
            cache[world_size] = run_distributed(
                _load_forward_save, world_size, args=(LAYOUTS[world_size], paths, tokens, out_root), timeout=600
            )
        return cache[world_size]

    return run


def _check_logits(world_size, checkpoints, runs):
    _, _, references = checkpoints
    seen = set()
    for rank_results in runs(world_size):
        for layout_name, variant, logits, _ in rank_results:
            if logits is None:
                continue
            seen.add((layout_name, variant))
            error = (logits - references[variant]).abs().max().item()
            assert error < TOLERANCE, f"{variant} at {layout_name}: max |logit error| {error:.2e}"
    assert seen == {(name, variant) for name, _ in LAYOUTS[world_size] for variant in VARIANTS}


def _check_round_trip(world_size, checkpoints, runs):
    paths, _, _ = checkpoints
    for layout_name, variant, _, out in runs(world_size)[0]:
        original, saved = read_safetensors_dir(paths[variant]), read_safetensors_dir(out)
        assert sorted(saved) == sorted(original), f"{variant} at {layout_name}: tensor names differ"
        for name, tensor in original.items():
            assert saved[name].dtype == tensor.dtype, f"{variant} at {layout_name}: {name} dtype"
            assert torch.equal(saved[name], tensor), f"{variant} at {layout_name}: {name} differs"


def test_logits_match_transformers(checkpoints, runs):
    _check_logits(2, checkpoints, runs)


def test_round_trip_is_bit_exact(checkpoints, runs):
    _check_round_trip(2, checkpoints, runs)


@pytest.mark.slow
def test_four_process_layouts_match_transformers_and_round_trip(checkpoints, runs):
    _check_logits(4, checkpoints, runs)
    _check_round_trip(4, checkpoints, runs)


def test_unsupported_settings_are_refused_with_the_reason():
    from megatron_gkd.models.deepseek_v3 import deepseek_v3_transformer_config

    hf = dict(YARN_LOW_RANK_Q, architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ValueError, match="rope_interleave"):
        deepseek_v3_transformer_config(dict(hf, rope_interleave=False))
    with pytest.raises(ValueError, match="2 \\* topk_group"):
        deepseek_v3_transformer_config(dict(hf, num_experts_per_tok=3))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        deepseek_v3_transformer_config(dict(hf, norm_topk_prob=False))
    # Grouping that selects every group is no constraint, whatever top-k.
    fields = deepseek_v3_transformer_config(dict(hf, num_experts_per_tok=3, topk_group=4))
    assert "moe_router_group_topk" not in fields
