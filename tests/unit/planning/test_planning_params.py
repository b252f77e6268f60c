"""Parameter counts: exact against models ``transformers`` builds, and against published totals."""

import pathlib

import pytest
import torch

from megatron_gkd.planning import count_parameters, model_shape, read_config
from megatron_gkd.testing.hf_models import TINY_CONFIGS
from megatron_gkd.testing.planner_memory import tiny_hf_config

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs" / "hf"


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
def test_counts_equal_the_transformers_model(architecture):
    import transformers

    hf = tiny_hf_config(architecture)
    model_class = getattr(transformers, architecture)
    with torch.device("meta"):
        model = model_class(model_class.config_class(**TINY_CONFIGS[architecture]))
    parameters = sum(p.numel() for p in model.parameters())
    # The checkpoint stores persistent buffers too (DeepSeek-V3's score-correction bias), not RoPE tables.
    stored = sum(t.numel() for name, t in model.state_dict().items() if "rotary_emb" not in name)
    if hf.get("tie_word_embeddings"):
        stored -= hf["vocab_size"] * hf["hidden_size"]  # save_pretrained writes the tied matrix once

    counts = count_parameters(model_shape(hf))
    assert counts.total == parameters
    assert counts.total + counts.buffers == stored == counts.checkpoint_elements
    activated_by_hand = parameters - sum(
        p.numel() * (1 - hf["num_experts_per_tok"] / p.shape[0])
        for name, p in model.named_parameters()
        if ".experts." in name
    )
    assert counts.activated == pytest.approx(activated_by_hand, abs=0)


def test_tiny_deepseek_mtp_module_is_one_more_moe_layer_with_projection_and_norms():
    import transformers

    hf = tiny_hf_config("DeepseekV3ForCausalLM", num_nextn_predict_layers=1)
    with torch.device("meta"):
        config = transformers.DeepseekV3Config(**TINY_CONFIGS["DeepseekV3ForCausalLM"])
        model = transformers.DeepseekV3ForCausalLM(config)
    moe_layer = sum(p.numel() for p in model.model.layers[-1].parameters())  # layers >= 1 are MoE
    h, v = hf["hidden_size"], hf["vocab_size"]

    base = count_parameters(model_shape(tiny_hf_config("DeepseekV3ForCausalLM")))
    counts = count_parameters(model_shape(hf))
    assert counts.total == base.total  # transformers (and the main model) leave MTP out
    assert counts.mtp_layers_only == moe_layer
    assert counts.mtp == moe_layer + 2 * h * h + 3 * h  # eh_proj, enorm, hnorm, shared_head.norm
    # The checkpoint stores the module with its own router bias and copies of embedding and head.
    assert counts.checkpoint_elements == base.checkpoint_elements + counts.mtp + hf["n_routed_experts"] + 2 * v * h


def _billions(n: int) -> float:
    return n / 1e9


def within_last_digit(value: float, published: float, digits: int) -> bool:
    """``published`` rounds or truncates ``value`` at ``digits`` decimals (a unit of the last digit)."""
    return abs(value - published) < 10**-digits


# (config, field, published value in billions, decimals it is published with, source)
PUBLISHED = [
    # DeepSeek-V3 README_WEIGHTS.md: main model 671B; MTP 11.5B unique excluding embedding and head,
    # 2.4B activated including them. The Hugging Face model page: 685B stored in all.
    ("deepseek-v3", "total", 671, 0),
    ("deepseek-v3", "mtp_layers_only", 11.5, 1),
    ("deepseek-v3", "mtp_activated", 2.4, 1),
    ("deepseek-v3", "checkpoint_elements", 685, 0),
    # DeepSeek-V3 technical report: 37B activated per token.
    ("deepseek-v3", "activated", 37, 0),
    # Qwen3 model cards: 235B total / 22B activated / 234B non-embedding; 30.5B / 3.3B / 29.9B; 8.2B / 6.95B.
    ("qwen3-235b-a22b", "total", 235, 0),
    ("qwen3-235b-a22b", "activated", 22, 0),
    ("qwen3-235b-a22b", "non_embedding", 234, 0),
    ("qwen3-30b-a3b", "total", 30.5, 1),
    ("qwen3-30b-a3b", "activated", 3.3, 1),
    ("qwen3-30b-a3b", "non_embedding", 29.9, 1),
    ("qwen3-8b", "total", 8.2, 1),
    ("qwen3-8b", "non_embedding", 6.95, 2),
    # Llama 3.1 8B: 8.03B on its model page.
    ("llama-3.1-8b", "total", 8.03, 2),
]


@pytest.mark.parametrize("name, field, published, digits", PUBLISHED, ids=[f"{p[0]}-{p[1]}" for p in PUBLISHED])
def test_real_configs_match_published_totals(name, field, published, digits):
    shape = model_shape(read_config(CONFIGS / name))
    counts = count_parameters(shape)
    if field == "non_embedding":
        value = counts.total - counts.embedding * (1 if shape.tie_word_embeddings else 2)
    else:
        value = getattr(counts, field)
    assert within_last_digit(_billions(value), published, digits), f"{name} {field}: {_billions(value):.4f} B"


def test_deepseek_v3_exact_figures():
    """The figures docs/scaling.md quotes; README_WEIGHTS' 36.7B activated is not reproducible."""
    counts = count_parameters(model_shape(read_config(CONFIGS / "deepseek-v3")))
    assert counts.total == 671_026_404_352
    assert counts.activated == 37_552_282_624
    assert counts.mtp == 11_610_067_968
    # Beyond the main model the checkpoint stores the MTP module with its own copies of embedding
    # and head, and the FP8 block scales: "685B = 671B main + 14B MTP".
    assert round((counts.checkpoint_elements - counts.total) / 1e9) == 14


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
def test_tensor_parallel_shards_add_up_to_each_tensor(architecture):
    from megatron_gkd.planning.params import MEGATRON, VLLM, embedding_tensor, layer_tensors, shard_elements

    m = model_shape(tiny_hf_config(architecture))
    for t in layer_tensors(m, moe=False) + [embedding_tensor(m)]:
        whole = shard_elements(t, m, engine=MEGATRON, tp=1, ep=1, etp=1)
        halves = 2 * shard_elements(t, m, engine=MEGATRON, tp=2, ep=1, etp=2)
        assert halves == (2 * whole if t.tp_dim is None else whole)
        if t.replicated_in_vllm:  # MLA's latent down-projections: whole on every vLLM rank
            assert shard_elements(t, m, engine=VLLM, tp=2, ep=1, etp=2) == whole
