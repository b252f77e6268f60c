"""Heavy teacher ids projected densely (megatron_gkd.losses.cross_vocab.heavy): with thresholds that make none, some
or all of a batch's ids heavy, the cross-tokenizer loss (unfused and fused, TP=1) equals the dense float64 reference;
a dense total too small to trust falls back to the per-entry path. TP=2 is tests/distributed/losses/
test_cross_vocab_tp.py::test_heavy_ids_match_reference."""

import pytest
import torch

from megatron_gkd.losses import shard_ops
from megatron_gkd.losses.cross_vocab import heavy as cross_vocab_heavy
from megatron_gkd.losses.cross_vocab.fused import fused_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.heavy import HeavyColumns, smallest_total
from megatron_gkd.losses.vocab_parallel import prepare_teacher
from megatron_gkd.testing.cross_vocab import (
    LOSS_CONFIGS,
    CrossCase,
    make_heavy_cases,
    reference_case,
    reference_cross_vocab_loss,
    relative,
    run_case,
)

pytestmark = pytest.mark.usefixtures("cross_vocab_paths")

CASES = make_heavy_cases()
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
# (min fan-in, min row share) -> the heavy ids of the cases' first rows: none, the three built heavy, every named id.
THRESHOLDS = {"none": (float("inf"), 0.0), "some": (8, 0.5), "all": (0, 0.0)}


def _heavy(case: CrossCase, dtype: torch.dtype = torch.float64) -> HeavyColumns | None:
    teacher = prepare_teacher(case.ids, case.logprobs, case.ids.shape[0], case.vocab_map.teacher_vocab_size, dtype)
    return HeavyColumns.select(teacher.ids, teacher.valid, case.vocab_map.shard(0, 1, 48), dtype)


@pytest.fixture(params=list(THRESHOLDS))
def thresholds(request, monkeypatch):
    min_fan_in, min_row_share = THRESHOLDS[request.param]
    monkeypatch.setattr(cross_vocab_heavy, "DENSE_MIN_FAN_IN", min_fan_in)
    monkeypatch.setattr(cross_vocab_heavy, "DENSE_MIN_ROW_SHARE", min_row_share)
    return request.param


def test_the_thresholds_pick_none_some_or_all_ids(thresholds):
    for case in CASES:
        heavy = _heavy(case)
        named = case.ids[torch.isfinite(case.logprobs)]
        if thresholds == "none":
            assert heavy is None
            continue
        picked = torch.unique(case.ids[heavy.is_heavy])
        if thresholds == "some":
            assert picked.tolist() == [0, 1, 2], case.name
        else:  # every named id some student reaches
            reached = torch.from_numpy(case.vocab_map.dense().sum(0).numpy() > 0)
            assert picked.tolist() == torch.unique(named[reached[named]]).tolist(), case.name


@pytest.mark.parametrize("method", ["projected", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_heavy_ids_give_the_reference(thresholds, method, dtype, monkeypatch):
    monkeypatch.setattr(shard_ops, "HOST_CHUNK_ELEMENTS", 3 * 48)  # blocks of a few rows
    for case in CASES:
        for loss_type, options in LOSS_CONFIGS:
            loss, grad, metrics = run_case(case, loss_type, options, dtype, method, 0, 1, None)
            expected, expected_grad = reference_case(case, loss_type, options, dtype, method)
            label = (case.name, loss_type)
            assert relative(loss, expected) <= TOLERANCE[dtype], label
            assert relative(grad, expected_grad) <= TOLERANCE[dtype], label
            if case.real_vocab_size is not None:
                assert grad[:, case.real_vocab_size:].abs().max().item() == 0.0, label
            assert all(bool(torch.isfinite(value).all()) for value in metrics.values()), label


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_fused_heavy_ids_give_the_reference(thresholds, chunk_size, monkeypatch):
    monkeypatch.setattr(shard_ops, "HOST_CHUNK_ELEMENTS", 3 * 48)
    generator = torch.Generator().manual_seed(5)
    for case in CASES:
        hidden = torch.randn(case.logits.shape[0], 12, generator=generator, dtype=torch.float64)
        weight = torch.randn(48, 12, generator=generator, dtype=torch.float64)
        for loss_type, options in LOSS_CONFIGS:
            for method in ("projected", "hybrid"):
                common = dict(loss_type=loss_type, temperature=case.temperature, real_vocab_size=case.real_vocab_size,
                              **options)
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                loss, _ = fused_cross_vocab_distill_loss(h, w, case.ids, case.logprobs,
                                                         case.vocab_map.shard(0, 1, 48, method), tp_group=None,
                                                         chunk_size=chunk_size, **common)
                (loss * case.grad_out).sum().backward()
                h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                dense = case.vocab_map.dense_hybrid() if method == "hybrid" else case.vocab_map.dense()
                expected = reference_cross_vocab_loss(h2 @ w2.t(), dense, case.ids, case.logprobs, **common)
                (expected * case.grad_out).sum().backward()
                label = (case.name, loss_type, method)
                assert relative(loss.detach(), expected.detach()) <= 1e-12, label
                assert relative(h.grad, h2.grad) <= 1e-12 and relative(w.grad, w2.grad) <= 1e-12, label


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_total_too_small_to_trust_falls_back_to_the_entries(dtype, monkeypatch):
    """Rows whose mass sits on one student outside the heavy ids' students by more than exp underflows: their heavy
    totals fall under smallest_total, the per-entry path (each slot's own maximum taken out) projects them, and the
    loss and gradient stay equal to the reference."""
    monkeypatch.setattr(cross_vocab_heavy, "DENSE_MIN_FAN_IN", 8)
    monkeypatch.setattr(cross_vocab_heavy, "DENSE_MIN_ROW_SHARE", 0.5)
    case = CASES[0]
    heavy = _heavy(case, dtype)
    outside = next(s for s in range(48) if s not in set(heavy.students.tolist()))
    logits = case.logits.clone()
    gap = 60.0 if dtype == torch.float32 else 500.0  # exp(-gap) under sqrt(smallest normal); the reference finite
    logits[::2, outside] += gap
    moved = CrossCase(**{**case.__dict__, "logits": logits, "temperature": 1.0})
    lse = torch.logsumexp(logits.to(dtype), dim=1)
    _, dense = heavy.pick(heavy.totals(heavy.factors(logits.to(dtype), lse, 1.0, dtype)), lse, slice(None))
    assert not dense[::2].any() and dense[1::2][heavy.is_heavy[1::2]].all()
    assert smallest_total(dtype) > 0
    for loss_type, options in LOSS_CONFIGS:
        loss, grad, _ = run_case(moved, loss_type, options, dtype, "projected", 0, 1, None)
        expected, expected_grad = reference_case(moved, loss_type, options, dtype, "projected")
        assert torch.isfinite(loss).all(), loss_type
        assert relative(loss, expected) <= TOLERANCE[dtype], loss_type
        assert relative(grad, expected_grad) <= TOLERANCE[dtype], loss_type
