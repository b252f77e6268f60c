"""The hidden signal in the student's plan: the frozen teacher head shard, the loss buffers, the hidden states."""

from __future__ import annotations

import json
import pathlib

import pytest

from megatron_gkd.planning import (
    Batch,
    StudentLayout,
    TeacherHeadShape,
    plan_student,
    plan_teacher_head,
    read_config,
    read_teacher_head,
    student_table,
    to_dict,
)
from megatron_gkd.planning.__main__ import run
from megatron_gkd.planning.teacher_head import HIDDEN_LOSS_CHUNK_BUFFERS

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs" / "hf"
BATCH = Batch(seq_length=4096, micro_batch_size=1, num_microbatches=8, chunk_size=512)
DEEPSEEK_V3 = TeacherHeadShape(129280, 7168, False)


def test_deepseek_v3_head_from_its_config():
    assert read_teacher_head(CONFIGS / "deepseek-v3") == DEEPSEEK_V3
    assert read_teacher_head(CONFIGS / "qwen3-8b") == (151936, 4096, False)


def test_shard_shape_and_bytes():
    head = plan_teacher_head(129280, DEEPSEEK_V3, tensor_model_parallel_size=2, params_dtype="bf16", chunk_size=1024)
    assert head.shape == (64640, 7168)
    assert head.shard_bytes == 64640 * 7168 * 2 == 926_679_040
    assert head.loss_buffer_bytes == HIDDEN_LOSS_CHUNK_BUFFERS * 1024 * 64640 * 4
    assert head.rows_without_teacher == 0 and "no teacher row" not in head.describe()
    longer = plan_teacher_head(151936, DEEPSEEK_V3, tensor_model_parallel_size=4, params_dtype="fp32", chunk_size=1)
    assert longer.shape == (37984, 7168) and longer.shard_bytes == 37984 * 7168 * 4
    assert longer.rows_without_teacher == 151936 - 129280
    assert "rows 129280-151935 of the student's table have no teacher row" in longer.describe()
    with pytest.raises(ValueError, match="does not split over tensor_model_parallel_size=3"):
        plan_teacher_head(129280, DEEPSEEK_V3, tensor_model_parallel_size=3, params_dtype="bf16", chunk_size=1)


@pytest.mark.parametrize("pp", [1, 2])
def test_the_last_stage_holds_the_frozen_head_and_the_hidden_states(pp):
    hf = read_config(CONFIGS / "qwen3-8b")
    layout = StudentLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp, data_parallel_size=2,
                           use_distributed_optimizer=True)
    topk = plan_student(hf, layout, BATCH)
    hidden = plan_student(hf, layout, BATCH, teacher_head=DEEPSEEK_V3)
    tokens = 4096 * 8
    for before, after in zip(topk.ranks, hidden.ranks):
        # Frozen: the parameters the optimizer sees, their gradients and state are the same.
        assert (after.parameters, after.memory.weights, after.memory.grads, after.memory.optimizer) == (
            before.parameters, before.memory.weights, before.memory.grads, before.memory.optimizer)
        last = after.pp_rank == pp - 1
        assert after.memory.teacher_head == (151936 // 2 * 7168 * 2 if last else 0)
        assert after.memory.hidden_loss == (HIDDEN_LOSS_CHUNK_BUFFERS * 512 * 151936 // 2 * 4 if last else 0)
        assert after.memory.teacher_hidden == (tokens * (7168 * 4 + 4) if last else 0)
        assert after.memory.teacher_topk == 0 and (before.memory.teacher_topk > 0) == last
        extra = after.memory.teacher_head + after.memory.hidden_loss + after.memory.teacher_hidden
        assert after.memory.total == before.memory.total - before.memory.teacher_topk + extra
    assert hidden.teacher_head.shape == (75968, 7168) and topk.teacher_head is None


def test_no_head_without_a_teacher_loss():
    hf = read_config(CONFIGS / "qwen3-8b")
    sft = Batch(seq_length=1024, loss="cross_entropy")
    plan = plan_student(hf, StudentLayout(), sft, teacher_head=DEEPSEEK_V3)
    assert plan.teacher_head is None and plan.ranks[0].memory.teacher_head == 0


def test_table_and_json_show_the_head():
    hf = read_config(CONFIGS / "qwen3-8b")
    plan = plan_student(hf, StudentLayout(tensor_model_parallel_size=2), BATCH, teacher_head=DEEPSEEK_V3)
    text = student_table(plan)
    assert "teacher head (hidden signal): teacher table 129280 x 7168 -> [75968, 7168] bf16 per student TP rank" in text
    assert "t-head" in text and "hid-loss" in text and "t-hidden" in text and "top-k" not in text
    data = json.loads(json.dumps(to_dict(plan)))
    assert data["teacher_head"]["shape"] == [75968, 7168]
    assert data["teacher_head"]["teacher"] == {"vocab_size": 129280, "hidden_size": 7168, "tied": False}
    assert data["ranks"][0]["memory"]["teacher_head"] == 75968 * 7168 * 2
    assert "top-k" in student_table(plan_student(hf, StudentLayout(tensor_model_parallel_size=2), BATCH))


def test_command_line():
    plan, text, _ = run(["student", "--hf", str(CONFIGS / "qwen3-8b"), "--tp", "2",
                         "--teacher-head", str(CONFIGS / "deepseek-v3"), "--chunk-size", "256"])
    assert plan.teacher_head.shape == (75968, 7168) and plan.batch.chunk_size == 256
    assert "[256, 75968] fp32" in text
    with pytest.raises(ValueError, match="--teacher-head plans the student's copy"):
        run(["teacher", "--hf", str(CONFIGS / "deepseek-v3"), "--teacher-head", str(CONFIGS / "deepseek-v3")])
