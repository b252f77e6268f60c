"""The weight rules' fusions against explicit reference layouts, and the registry / config readers."""

from __future__ import annotations

import pytest
import torch

from megatron_gkd.models import Concat, QKVFusion, WeightRule, get_architecture, supported_architectures
from megatron_gkd.models.hf_config import rope_settings
from megatron_gkd.models.llama import rope_model_kwargs
from megatron_gkd.models.mapping import tp_slice_index
from megatron_gkd.models.qwen import moe_layer_pattern
from megatron_gkd.parallel import shard_for_rank

HEAD_DIM, HIDDEN = 4, 6


def _qkv(num_heads: int, num_groups: int, *rest: int):
    q = torch.randn(num_heads * HEAD_DIM, *rest, dtype=torch.float64)
    k = torch.randn(num_groups * HEAD_DIM, *rest, dtype=torch.float64)
    v = torch.randn(num_groups * HEAD_DIM, *rest, dtype=torch.float64)
    return q, k, v


def _megatron_qkv_reference(q, k, v, num_heads: int, num_groups: int) -> torch.Tensor:
    """Megatron's linear_qkv rows written out head by head: per group its query heads, its key, its value."""
    per_group = num_heads // num_groups
    rows = []
    for group in range(num_groups):
        for head in range(group * per_group, (group + 1) * per_group):
            rows.append(q[head * HEAD_DIM : (head + 1) * HEAD_DIM])
        rows.append(k[group * HEAD_DIM : (group + 1) * HEAD_DIM])
        rows.append(v[group * HEAD_DIM : (group + 1) * HEAD_DIM])
    return torch.cat(rows)


@pytest.mark.parametrize("num_heads,num_groups", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("rest", [(HIDDEN,), ()], ids=["weight", "bias"])
def test_qkv_fusion_matches_megatron_layout_and_inverts(num_heads, num_groups, rest):
    q, k, v = _qkv(num_heads, num_groups, *rest)
    fusion = QKVFusion(head_dim=HEAD_DIM, heads_per_group=num_heads // num_groups)
    fused = fusion.fuse([q, k, v])
    assert torch.equal(fused, _megatron_qkv_reference(q, k, v, num_heads, num_groups))
    for original, back in zip((q, k, v), fusion.split(fused)):
        assert torch.equal(original, back)


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_fusion_of_tp_slices_is_the_tp_shard(tp):
    num_heads, num_groups = 8, 4
    q, k, v = _qkv(num_heads, num_groups, HIDDEN)
    fusion = QKVFusion(head_dim=HEAD_DIM, heads_per_group=2)
    full = fusion.fuse([q, k, v])
    for rank in range(tp):
        slices = [part[tp_slice_index(part.shape, 0, rank, tp, "x")] for part in (q, k, v)]
        assert torch.equal(fusion.fuse(slices), shard_for_rank(full, 0, rank, tp))


def test_gate_up_concat_of_tp_slices_is_megatrons_fc1_shard():
    gate, up = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    full = Concat(2).fuse([gate, up])
    for rank in range(2):
        slices = [part[tp_slice_index(part.shape, 0, rank, 2, "x")] for part in (gate, up)]
        assert torch.equal(Concat(2).fuse(slices), shard_for_rank(full, 0, rank, 2, num_parts=2))
    assert all(torch.equal(a, b) for a, b in zip(Concat(2).split(full), (gate, up)))


def test_rule_matches_local_and_te_names_with_global_fields():
    rule = WeightRule(
        ("decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight",
         "decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}"),
        ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"),
        (0, 0),
        Concat(2),
    )
    assert rule.is_expert
    fields = rule.match("decoder.layers.3.mlp.experts.linear_fc1.weight12")
    assert fields == {"layer": "3", "expert": "12"}
    assert rule.hf_names(rule.match("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"))[1] == (
        "model.layers.3.mlp.experts.5.up_proj.weight"
    )
    assert rule.match("decoder.layers.3.mlp.linear_fc1.weight") is None


def test_uneven_tp_split_names_the_tensor():
    with pytest.raises(ValueError, match="lm_head.weight"):
        tp_slice_index((255, 8), 0, 0, 2, "lm_head.weight")


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError) as error:
        get_architecture({"architectures": ["GPT2LMHeadModel"]})
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert name in supported_architectures()
        assert name in str(error.value)


def test_rope_settings_read_v4_and_v5_keys():
    v4 = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    v5 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    assert rope_settings(v4) == rope_settings(v5)
    assert rope_settings({}).theta == 10000.0 and rope_settings({}).rope_type == "default"
    assert rope_model_kwargs(v5) == dict(
        position_embedding_type="rope", rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0
    )


def test_rope_variants_megatron_cannot_express_are_rejected():
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_model_kwargs({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}})
    with pytest.raises(ValueError, match="dynamic"):
        rope_model_kwargs({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})


def test_moe_layer_pattern_follows_hf_rules():
    assert moe_layer_pattern({"num_hidden_layers": 4, "mlp_only_layers": [1]}) == [1, 0, 1, 1]
    assert moe_layer_pattern({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == [0, 1, 0, 1]


# Parameter names of Megatron's Transformer Engine spec (layer norms fused into linear_qkv / a dense
# linear_fc1, grouped-GEMM experts numbered by suffix), written out from megatron-core 0.16.1's TE
# modules since Transformer Engine does not import on this machine.
TE_NAMES_QWEN3_MOE = {
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": ["model.layers.0.input_layernorm.weight"],
    "decoder.layers.0.self_attention.linear_qkv.weight": [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ],
    "decoder.layers.0.self_attention.q_layernorm.weight": ["model.layers.0.self_attn.q_norm.weight"],
    "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": ["model.layers.0.post_attention_layernorm.weight"],
    "decoder.layers.0.mlp.linear_fc1.weight": ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"],
    "decoder.layers.1.pre_mlp_layernorm.weight": ["model.layers.1.post_attention_layernorm.weight"],
    "decoder.layers.1.mlp.router.weight": ["model.layers.1.mlp.gate.weight"],
    "decoder.layers.1.mlp.experts.linear_fc1.weight3": [
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    ],
    "decoder.layers.1.mlp.experts.linear_fc2.weight3": ["model.layers.1.mlp.experts.3.down_proj.weight"],
}


def test_transformer_engine_parameter_names_are_mapped():
    from megatron_gkd.models.mapping import find_rule
    from megatron_gkd.testing.hf_models import TINY_CONFIGS

    config = {**TINY_CONFIGS["Qwen3MoeForCausalLM"], "architectures": ["Qwen3MoeForCausalLM"]}
    rules = get_architecture(config).weight_rules(config)
    for name, hf_names in TE_NAMES_QWEN3_MOE.items():
        rule, fields = find_rule(rules, name)
        assert rule.hf_names(fields) == hf_names, name
