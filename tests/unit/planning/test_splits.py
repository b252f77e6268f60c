"""``planning.splits``: what a layout asks of a model's shape, on HF config dicts (no torch, no weights)."""

import pathlib

import pytest

from megatron_gkd.planning import model_shape, read_config
from megatron_gkd.planning.splits import check_split
from megatron_gkd.testing.hf_models import SMOLLM2_LIKE, TINY_CONFIGS

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs" / "hf"
SMOLLM2 = model_shape({"architectures": ["LlamaForCausalLM"], **SMOLLM2_LIKE})


def test_heads_split_only_where_both_counts_do():
    with pytest.raises(ValueError, match="9 attention heads and 3 key/value heads, which do not split across "
                                         "tensor_model_parallel_size=2"):
        check_split(SMOLLM2, tensor_model_parallel_size=2)
    split = check_split(SMOLLM2, tensor_model_parallel_size=3)
    assert split.describe() == ["LlamaForCausalLM: 9 attention heads / 3 key/value heads -> 3 / 1 a TP rank; "
                                "2 layers -> 2 a stage"]
    # Multi-latent attention has no key/value heads of its own: its heads alone must split.
    with pytest.raises(ValueError, match=r"has 128 attention heads, which do not split across "
                                         r"parallel\.tensor_model_parallel_size=3 .* to 1, 2, 4, 8, 16, 32, 64 or 128"):
        check_split(model_shape(read_config(CONFIGS / "deepseek-v3")), tensor_model_parallel_size=3, key="parallel.")


def test_the_sizes_offered_also_split_the_vocabulary():
    # 9 / 3 heads split over TP 3, but a 250-row table splits over no TP but 1.
    with pytest.raises(ValueError, match="has 250 vocabulary rows, which do not split across "
                                         "tensor_model_parallel_size=3 .* to 1, or pad"):
        check_split(model_shape({"architectures": ["LlamaForCausalLM"], **SMOLLM2_LIKE, "vocab_size": 250}),
                    tensor_model_parallel_size=3)


def test_the_vocabulary_line_states_padding_rows_and_refuses_a_longer_tokenizer():
    split = check_split(SMOLLM2, tensor_model_parallel_size=3)
    assert split.vocabulary(250).startswith("vocabulary: 252 rows for 250 tokenizer ids (2 padding rows, ids 250-251")
    assert "252 rows for 252 tokenizer ids (no padding rows) -> 84 a TP rank" in split.vocabulary(252)
    with pytest.raises(ValueError, match="the tokenizer has 253 ids but LlamaForCausalLM's table has 252 rows"):
        split.vocabulary(253)


def test_experts_split_over_expert_parallel_ranks():
    moe = model_shape(read_config(CONFIGS / "qwen3-30b-a3b"))
    with pytest.raises(ValueError, match="has 128 routed experts, which do not split across "
                                         "expert_model_parallel_size=3; set it to 1, 2, 4, 8, 16, 32, 64 or 128"):
        check_split(moe, expert_model_parallel_size=3)
    assert "128 routed experts -> 16 an EP rank" in check_split(moe, expert_model_parallel_size=8).describe()[0]
    # A dense model at EP > 1 is not refused here: a dense teacher runs in an MoE student's layout.
    check_split(SMOLLM2, expert_model_parallel_size=2)


def test_a_tied_output_layer_on_another_stage_is_described_with_its_embedding_groups():
    split = check_split(SMOLLM2, pipeline_model_parallel_size=2)
    assert split.tied_copy and not check_split(SMOLLM2).tied_copy
    [_, tied] = split.describe(world_size=4)
    assert tied.startswith("tied embeddings over 2 stages: the last stage keeps its own copy of the embedding as its "
                           "output layer ([252, 576] a TP rank")
    assert tied.endswith("embedding groups (first-stage rank, last-stage rank): (0, 2), (1, 3)")
    untied = model_shape({"architectures": ["LlamaForCausalLM"], **TINY_CONFIGS["LlamaForCausalLM"]})
    assert len(check_split(untied, pipeline_model_parallel_size=2).describe()) == 1
