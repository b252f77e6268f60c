"""A cross-tokenizer teacher's hidden signal through the step's loss (``teacher.cross_tokenizer.hidden_support``).

With ``full`` the step's loss, its gradient on the student's logit shard and its ``unmapped_teacher_mass`` equal the
dense float64 reference (the teacher's whole distribution compared with the student projected through ``W``,
:func:`megatron_gkd.testing.cross_vocab.reference_hidden_cross_vocab_loss`) at TP=1 and TP=2 (gloo ranks, both
vocabularies split, padding rows on both sides); a position outside the loss mask, or without a teacher hidden
state (all zero: inside a group, or unaligned), is not compared; the metric reaches ``train/unmapped_teacher_mass``.
``topk`` at a small k is another loss, so the comparison shows which form the step ran.

The body calls the loss function :class:`~megatron_gkd.trainer.step.StepRunner` hands Megatron's schedule for the
last stage (``_loss``) on given logit shards: the dispatch, masking and statistics of the real step, without a
student model.
"""

import dataclasses
import types

import pytest
import torch

from megatron_gkd.testing.cross_vocab import (
    LOSS_CONFIGS,
    make_hidden_case,
    reference_hidden_cross_vocab_loss,
    relative,
    shard,
)
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.trainer.metrics import loss_metrics

pytestmark = pytest.mark.distributed

B, S = 2, 5  # the micro-batch's [b, s]; case row i is position (i // S, i % S)
NO_HIDDEN, MASKED = 3, 7  # a position the teacher sent no hidden state for, one outside the loss mask
REAL, TEACHER_REAL, TEACHER_TOP_K = 21, 17, 4
TEMPERATURE, TEACHER_TEMPERATURE = 0.8, 1.3
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}


def _case():
    case = make_hidden_case(6, num_rows=B * S, real_vocab_size=REAL, teacher_real_vocab_size=TEACHER_REAL)
    hidden = case.teacher_hidden.clone()
    hidden[NO_HIDDEN] = 0.0
    return dataclasses.replace(case, teacher_hidden=hidden)


def _loss_mask() -> torch.Tensor:
    mask = torch.ones(B * S, dtype=torch.bool)
    mask[MASKED] = False
    return mask


def _reference(case, loss_type: str, options: dict):
    """``(loss, grad [N, V_s], unmapped teacher mass, compared tokens)`` in float64 from the definitions."""
    weights = case.weights * _loss_mask() * (case.teacher_hidden != 0).any(-1)
    logits = case.logits.clone().requires_grad_()
    dense = case.vocab_map.dense()
    per_token = reference_hidden_cross_vocab_loss(logits, dense, case.teacher_hidden, case.teacher_head, loss_type,
                                                  TEMPERATURE, TEACHER_TEMPERATURE, real_vocab_size=REAL,
                                                  teacher_real_vocab_size=TEACHER_REAL, **options)
    total = (per_token * weights).sum()
    total.backward()
    teacher = torch.softmax((case.teacher_hidden @ case.teacher_head.t())[:, :TEACHER_REAL] / TEACHER_TEMPERATURE, -1)
    unreached = dense.sum(0) == 0  # no student token maps there: q = 0 exactly
    unmapped = (teacher[:, unreached].sum(1) * (weights != 0)).sum()
    return float(total.detach()), logits.grad, float(unmapped), int((weights != 0).sum())


def _step_loss(case, loss_type: str, options: dict, dtype: torch.dtype, hidden_support: str):
    """This rank's ``(loss, grad [N, V_s/tp], stats)`` from the step's loss function."""
    import torch.distributed as dist

    from megatron_gkd.trainer.batch import MicroBatch, TeacherSlice
    from megatron_gkd.trainer.specs import LossSpec
    from megatron_gkd.trainer.step import StepRunner

    rank, tp = dist.get_rank(), dist.get_world_size()
    vocab = case.logits.shape[1]
    # [s, b, V/tp], as the output layer makes them
    logits = shard(case.logits, rank, tp).to(dtype).view(B, S, -1).transpose(0, 1).contiguous().requires_grad_()
    coefficients = case.weights.view(B, S)
    teacher = TeacherSlice("teacher", coefficients, torch.zeros(B, S, 0, dtype=torch.long), torch.zeros(B, S, 0),
                           case.teacher_hidden.to(dtype).view(B, S, -1))
    microbatch = MicroBatch(tokens=torch.zeros(B, S, dtype=torch.long), position_ids=torch.zeros(B, S, dtype=torch.long),
                            loss_mask=_loss_mask().view(B, S), coefficients=coefficients, teachers=[teacher])
    spec = LossSpec(loss_type=loss_type, options=dict(options), temperature=TEMPERATURE, signal="hidden",
                    teacher_temperature=TEACHER_TEMPERATURE, real_vocab_size=REAL, chunk_size=3,
                    projection=case.vocab_map.shard(rank, tp, vocab // tp), teacher_top_k=TEACHER_TOP_K,
                    teacher_real_vocab_size=TEACHER_REAL, hidden_support=hidden_support)
    head = case.teacher_head.chunk(tp, dim=0)[rank].to(dtype)  # [V_t/tp, h_t]
    runner = StepRunner([], None, None, tp_group=dist.group.WORLD, dp_group=None, dp_size=1, is_last_stage=True,
                        teacher_heads={"teacher": head})
    contribution, stats = runner._loss(spec, microbatch, types.SimpleNamespace(logits=logits),
                                       torch.zeros(B, S, 0, dtype=dtype))
    contribution.backward()
    return float(contribution), logits.grad.transpose(0, 1).reshape(B * S, -1), {k: float(v) for k, v in stats.items()}


def _body() -> list[dict]:
    import torch.distributed as dist

    rank, tp = dist.get_rank(), dist.get_world_size()
    case = _case()
    rows = []
    for loss_type, options in LOSS_CONFIGS:
        expected, expected_grad, unmapped, compared = _reference(case, loss_type, options)
        for dtype in (torch.float64, torch.float32):
            loss, grad, stats = _step_loss(case, loss_type, options, dtype, "full")
            topk_loss, _, _ = _step_loss(case, loss_type, options, dtype, "topk")
            rows.append({
                "loss_type": loss_type, "dtype": str(dtype).removeprefix("torch."),
                "loss": relative(torch.tensor(loss), torch.tensor(expected)),
                "grad": relative(grad, shard(expected_grad, rank, tp)),
                "skipped_grad": float(grad[[NO_HIDDEN, MASKED, 1]].abs().max()),  # row 1: coefficient 0
                "unmapped_expected": unmapped,
                "unmapped": relative(torch.tensor(stats["unmapped_teacher_mass"]), torch.tensor(unmapped)),
                "logged": loss_metrics(stats).get("train/unmapped_teacher_mass", -1.0) * stats["tokens"]
                - stats["unmapped_teacher_mass"],  # train/* holds it per loss token
                "compared_mass": stats["teacher_mass"] + stats["unmapped_teacher_mass"] - compared,
                "topk": relative(torch.tensor(topk_loss), torch.tensor(expected)),
                "stats_loss": relative(torch.tensor(stats["loss"]), torch.tensor(loss)),
            })
    return rows


@pytest.mark.parametrize("tp", [1, 2])
def test_full_support_step_matches_the_dense_reference(tp):
    for rank, rows in enumerate(run_distributed(_body, tp)):
        assert len(rows) == 2 * len(LOSS_CONFIGS)
        for row in rows:
            where = (tp, rank, row["loss_type"], row["dtype"])
            tolerance = TOLERANCE[row["dtype"]]
            assert row["loss"] <= tolerance and row["grad"] <= tolerance, (where, row)
            assert row["skipped_grad"] == 0.0, where
            assert row["unmapped_expected"] > 0  # the map leaves teacher ids unreached: the metric is not trivially 0
            assert row["unmapped"] <= 1e-5 and abs(row["compared_mass"]) <= 1e-5, (where, row)
            assert row["stats_loss"] <= 1e-6 and abs(row["logged"]) <= 1e-12, where
            assert row["topk"] > 1e-3, where  # top-4 of 17 ids is another loss: the step ran the full form
