"""Student plans: Megatron's byte accounting, pipeline schedules, activation terms and their switches."""

import pathlib

import pytest

from megatron_gkd.planning import Batch, StudentLayout, model_shape, plan_student, read_config
from megatron_gkd.planning import activations as acts
from megatron_gkd.planning.student import in_flight_microbatches, stage_layers
from megatron_gkd.testing.planner_memory import tiny_hf_config

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs" / "hf"
BATCH = Batch(seq_length=4096, micro_batch_size=1, num_microbatches=8)


def _qwen3_8b():
    return read_config(CONFIGS / "qwen3-8b")


def _rank(layout, batch=BATCH, hf=None):
    return plan_student(hf or _qwen3_8b(), layout, batch).ranks


@pytest.mark.parametrize(
    "dtype, distopt, per_param",
    [("bf16", False, 2 + 4 + 12), ("fp32", False, 4 + 4 + 8), ("bf16", True, 2 + 4 + 12 / 4), ("fp8", False, 1 + 4 + 12)],
)
def test_bytes_per_parameter_follow_megatron(dtype, distopt, per_param):
    layout = StudentLayout(params_dtype=dtype, data_parallel_size=4, use_distributed_optimizer=distopt)
    [rank] = _rank(layout)
    memory = rank.memory
    assert memory.weights + memory.grads + memory.optimizer == pytest.approx(per_param * rank.parameters, rel=1e-9)


def test_expert_optimizer_state_shards_over_expert_data_parallel_ranks():
    hf = read_config(CONFIGS / "qwen3-30b-a3b")
    layout = StudentLayout(
        expert_model_parallel_size=8, expert_tensor_parallel_size=1, data_parallel_size=16, use_distributed_optimizer=True
    )
    [rank] = _rank(layout, hf=hf)
    dense = rank.parameters - rank.expert_parameters
    assert layout.expert_data_parallel_size == 2
    assert rank.memory.optimizer == int(12 * (dense / 16 + rank.expert_parameters / 2))
    assert rank.expert_parameters * 8 == pytest.approx(sum(
        v for k, v in plan_student(hf, StudentLayout(), BATCH).counts.by_group.items() if k == "experts"
    ))


def test_layers_split_like_megatron():
    layout = StudentLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert stage_layers(8, layout) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    uneven = StudentLayout(pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=3)
    assert [len(stage[0]) for stage in stage_layers(10, uneven)] == [3, 4, 3]
    with pytest.raises(ValueError, match="do not split"):
        stage_layers(61, StudentLayout(pipeline_model_parallel_size=2))


def test_in_flight_microbatches_of_1f1b_schedules():
    plain = StudentLayout(pipeline_model_parallel_size=4)
    assert [in_flight_microbatches(r, plain, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(0, plain, 2) == 2
    interleaved = StudentLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    # Megatron's warm-up: (pp - rank - 1) * 2 + (vpp - 1) * pp, plus the one in its steady state.
    assert [in_flight_microbatches(r, interleaved, 8) for r in range(2)] == [5, 3]


def test_first_stage_holds_pp_microbatches():
    ranks = _rank(StudentLayout(pipeline_model_parallel_size=4))
    single = _rank(StudentLayout(pipeline_model_parallel_size=4), Batch(seq_length=4096, num_microbatches=1))
    assert ranks[0].memory.activations == 4 * single[0].memory.activations
    assert ranks[1].memory.activations == 3 * single[1].memory.activations


def test_fused_activations_are_linear_in_sequence_length_local_ones_are_not():
    fused = [_rank(StudentLayout(), Batch(seq_length=s))[0].memory.activations for s in (2048, 4096)]
    local = [_rank(StudentLayout(kernels="local"), Batch(seq_length=s))[0].memory.activations for s in (2048, 4096)]
    logits = 2048 * 151936 * 2  # the distill loss keeps the bf16 logits; linear too
    assert fused[1] == pytest.approx(2 * fused[0], rel=1e-6) and logits > 0
    assert local[1] > 2.5 * local[0]  # the s x s softmax dominates


def test_fused_layer_terms_add_up():
    m = model_shape(_qwen3_8b())
    ctx = acts.Context(seq_length=4096, act_bytes=2, kernels="fused")
    terms = acts.gqa_attention_terms(m, ctx) + acts.dense_mlp_terms(m, ctx)
    h, a, g, d, f = m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.ffn_hidden_size
    norms = 2 * (2 * h + 4 + 2 * h)  # input + normalised output (bf16) and float32 rstd, twice
    attention = 2 * (a + 2 * g) * d + 2 * (a + 2 * g) * d + 4 * a + 2 * a * d  # qk-norm input, q/k/v, lse, out
    assert acts.layer_bytes_per_token(terms, 1, False) == norms + attention + 2 * 3 * f


def test_sequence_parallel_and_recomputation_shrink_activations():
    base = StudentLayout(tensor_model_parallel_size=2, kernels="local")
    stored = _rank(base)[0].memory.activations
    with_sp = _rank(StudentLayout(tensor_model_parallel_size=2, sequence_parallel=True, kernels="local"))[0]
    selective = _rank(StudentLayout(tensor_model_parallel_size=2, kernels="local", recompute_granularity="selective"))[0]
    full = _rank(StudentLayout(tensor_model_parallel_size=2, kernels="local", recompute_granularity="full"))[0]
    assert with_sp.memory.activations < stored
    assert selective.memory.activations < stored
    m = model_shape(_qwen3_8b())
    final = 4096 * sum(t.bytes_per_token(2, False) for t in acts.final_terms(m, acts.Context(4096, 2, "local"), "distill"))
    # Full recomputation keeps each layer's bf16 input, [s, b, h], and rebuilds one layer in the backward.
    assert full.memory.activations == int(m.num_layers * 4096 * m.hidden_size * 2 + final)
    assert full.memory.backward_workspace > selective.memory.backward_workspace


def test_last_stage_carries_logits_teacher_topk_and_the_tied_output_copy():
    hf = tiny_hf_config("Qwen2ForCausalLM")  # tied embeddings
    ranks = plan_student(hf, StudentLayout(pipeline_model_parallel_size=2), Batch(seq_length=64, top_k=8))
    vocab = hf["vocab_size"] * hf["hidden_size"]
    assert ranks.ranks[1].parameters - ranks.ranks[0].parameters == hf["hidden_size"]  # final norm; both hold V x h
    assert ranks.ranks[0].parameters > vocab and ranks.ranks[1].parameters > vocab
    assert ranks.ranks[0].memory.teacher_topk == 0
    assert ranks.ranks[1].memory.teacher_topk == 64 * 8 * 12


def test_layouts_that_do_not_split_say_why():
    hf = _qwen3_8b()
    with pytest.raises(ValueError, match="32 attention heads and 8 key/value heads, which do not split across "
                                         "tensor_model_parallel_size=16"):
        _rank(StudentLayout(tensor_model_parallel_size=16), hf=hf)
    moe = read_config(CONFIGS / "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="sequence_parallel"):
        _rank(StudentLayout(tensor_model_parallel_size=2), hf=moe)
    with pytest.raises(ValueError, match="expert_model_parallel_size=3"):
        _rank(StudentLayout(expert_model_parallel_size=3, data_parallel_size=3), hf=moe)
    with pytest.raises(ValueError, match="params_dtype"):
        StudentLayout(params_dtype="int4")


def test_selective_recompute_keeps_the_attention_inputs():
    m = model_shape(_qwen3_8b())
    fused = _rank(StudentLayout())[0].memory.activations
    fused_selective = _rank(StudentLayout(recompute_granularity="selective"))[0].memory.activations
    # Flash attention saves only its log-sum-exp beyond its inputs; that is all selective saves.
    assert fused - fused_selective == m.num_layers * 4096 * m.num_attention_heads * 4
    local = _rank(StudentLayout(kernels="local"))[0].memory.activations
    local_selective = _rank(StudentLayout(kernels="local", recompute_granularity="selective"))[0].memory.activations
    a, g, d, s = m.num_attention_heads, m.num_key_value_heads, m.head_dim, 4096
    # Unfused: the float32 and bf16 score matrices and the keys/values expanded from g to a heads.
    per_token = a * s * (4 + 2) + 2 * (a - g) * d * 2
    assert local - local_selective == m.num_layers * s * per_token


def test_layout_from_megatron_parallel_sizes():
    layout = StudentLayout.from_parallel_sizes(
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=4), 16
    )
    assert (layout.data_parallel_size, layout.expert_data_parallel_size) == (4, 1)
    with pytest.raises(ValueError, match="context_parallel_size"):
        StudentLayout.from_parallel_sizes(dict(context_parallel_size=2), 2)


def test_inert_options_are_noted(caplog):
    plan = plan_student(_qwen3_8b(), StudentLayout(include_mtp=True, moe_imbalance=1.3), BATCH)
    assert any("no MTP layers" in note for note in plan.notes)
    assert any("no routed experts" in note for note in plan.notes)
    assert "no MTP layers" in caplog.text
