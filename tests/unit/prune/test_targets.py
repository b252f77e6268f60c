"""The sizes a student keeps: counts and fractions, valid grouped-query head counts, the written config."""

import pytest

from megatron_gkd.prune import ModelSizes, PruneTargets, parameter_count, parse_size, pruned_hf_config
from megatron_gkd.testing.pruning import GQA_ODD

SMOL = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def test_sizes_of_a_gqa_config():
    sizes = ModelSizes.of(SMOL)
    assert (sizes.num_layers, sizes.hidden_size, sizes.ffn_hidden_size) == (30, 576, 1536)
    assert (sizes.num_attention_heads, sizes.num_query_groups, sizes.kv_channels, sizes.heads_per_group) == (9, 3, 64, 3)


def test_counts_and_fractions_resolve():
    student = PruneTargets(num_layers=10, hidden_size=0.75, ffn_hidden_size=0.5).resolve(ModelSizes.of(SMOL))
    assert (student.num_layers, student.hidden_size, student.ffn_hidden_size) == (10, 432, 768)
    assert (student.num_attention_heads, student.num_query_groups, student.kv_channels) == (9, 3, 64)
    assert PruneTargets(num_layers=0.01).resolve(ModelSizes.of(SMOL)).num_layers == 1  # at least one
    assert parse_size("10") == 10 and parse_size("0.5") == 0.5
    with pytest.raises(ValueError, match="neither a count"):
        parse_size("half")


def test_heads_are_pruned_inside_the_groups_by_default_and_with_the_groups_when_asked():
    teacher = ModelSizes.of(SMOL)
    inside = PruneTargets(num_attention_heads=6).resolve(teacher)
    assert (inside.num_attention_heads, inside.num_query_groups) == (6, 3)
    groups = PruneTargets(num_query_groups=2).resolve(teacher)
    assert (groups.num_attention_heads, groups.num_query_groups) == (6, 2)  # each kept group keeps its 3 heads
    both = PruneTargets(num_query_groups=1, num_attention_heads=2).resolve(teacher)
    assert (both.num_attention_heads, both.num_query_groups) == (2, 1)


@pytest.mark.parametrize("targets, message", [
    (dict(num_attention_heads=5), r"choose one of \[3, 6, 9\]"),
    (dict(num_attention_heads=12), r"choose one of \[3, 6, 9\]"),  # a group cannot grow
    (dict(num_query_groups=2, num_attention_heads=3), r"choose one of \[2, 4, 6\]"),
    (dict(num_query_groups=4), "exceeds the teacher's 3"),
    (dict(num_layers=31), "exceeds the teacher's 30"),
    (dict(hidden_size=1.5), r"a fraction lies in \(0, 1\]"),
    (dict(ffn_hidden_size=0), "keep at least 1"),
    (dict(num_attention_heads=0.5), "whole heads"),
])
def test_invalid_targets_name_the_fix(targets, message):
    with pytest.raises(ValueError, match=message):
        PruneTargets(**targets).resolve(ModelSizes.of(SMOL))


def test_a_llama_students_hidden_size_is_a_multiple_of_its_heads():
    """transformers 5's LlamaConfig refuses other hidden sizes even with head_dim given (Qwen2's and Qwen3's do not)."""
    teacher = ModelSizes.of(SMOL)
    with pytest.raises(ValueError, match="hidden_size=384 is not a multiple of num_attention_heads=9.*choose e.g. 378 or 387"):
        PruneTargets(hidden_size=384).resolve(teacher)
    assert PruneTargets(hidden_size=384, num_attention_heads=6).resolve(teacher).hidden_size == 384
    assert PruneTargets(hidden_size=0.66).resolve(teacher).hidden_size == 378  # 380.2 rounded to a multiple of 9
    qwen2 = ModelSizes.of(dict(SMOL, architectures=["Qwen2ForCausalLM"]))
    assert PruneTargets(hidden_size=384).resolve(qwen2).hidden_size == 384


def test_moe_and_mla_teachers_are_refused():
    moe = dict(SMOL, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=64)
    with pytest.raises(ValueError, match="routed experts; pruning supports dense"):
        ModelSizes.of(moe)


def test_pruned_config_states_head_dim_and_keeps_the_kept_layers_types():
    config = dict(SMOL, head_dim=None, layer_types=[f"type{i}" for i in range(30)])
    config.pop("head_dim")
    student = PruneTargets(num_layers=3, num_attention_heads=6, hidden_size=384).resolve(ModelSizes.of(SMOL))
    pruned = pruned_hf_config(config, student, kept_layers=[0, 7, 29])
    # transformers would derive 384 // 6 = 64 here by luck; the head size is what the weights hold.
    assert pruned["head_dim"] == 64 and pruned["hidden_size"] == 384 and pruned["num_attention_heads"] == 6
    assert pruned["num_key_value_heads"] == 3 and pruned["num_hidden_layers"] == 3
    assert pruned["layer_types"] == ["type0", "type7", "type29"]
    assert pruned["tie_word_embeddings"] is True and config["num_hidden_layers"] == 30  # the teacher's is untouched


def test_parameter_counts_of_smollm2_and_a_third_of_its_depth():
    assert parameter_count(SMOL) == 134_515_008  # SmolLM2-135M as model.parameters() counts it
    student = PruneTargets(num_layers=10).resolve(ModelSizes.of(SMOL))
    assert parameter_count(pruned_hf_config(SMOL, student, list(range(10)))) == 28_311_552 + 576 + 10 * 3_540_096


def test_the_tiny_gqa_shape_is_smollm2s():
    sizes = ModelSizes.of(dict(GQA_ODD, architectures=["LlamaForCausalLM"], vocab_size=256))
    assert (sizes.num_attention_heads, sizes.num_query_groups, sizes.kv_channels) == (9, 3, 16)
