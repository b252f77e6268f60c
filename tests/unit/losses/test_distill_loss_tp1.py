"""Unfused vocab-parallel losses at TP=1 against the dense float64 reference, plus API behaviour."""

import math

import pytest
import torch

from megatron_gkd.losses import (
    get_divergence,
    registered_divergences,
    vocab_parallel_distill_loss,
    vocab_parallel_topk,
)
from megatron_gkd.losses.reference import reference_distill_loss, reference_names
from megatron_gkd.testing import losses as cases


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_every_loss_matches_dense_reference_tp1(dtype):
    results = [
        cases.check_case(case, loss_type, options, dtype, rank=0, tp_size=1, group=None)
        for case in cases.make_cases(tp_size=1)
        for loss_type, options in cases.LOSS_CONFIGS
    ]
    assert len(results) == len(cases.make_cases(1)) * len(cases.LOSS_CONFIGS)
    assert cases.failures(results) == []


def test_every_registered_loss_is_covered_and_has_a_reference():
    """The cases come from the registry (testing/divergence_cases.py), so a new divergence is checked here by its name;
    its reference must exist (TCAD's is written into reference_distill_loss: its coverage term reads the student's
    logits off the support)."""
    assert {name for name, _ in cases.LOSS_CONFIGS} == set(registered_divergences())
    assert {"forward_kl", "reverse_kl", "jsd", "kl_rkl", "tcad"} <= set(registered_divergences())
    plain = {name for name in registered_divergences() if not get_divergence(name).student_support}
    assert plain <= set(reference_names())


def _inputs(seed=0, n=10, v=40, k=6):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=generator)
    teacher = torch.log_softmax(torch.randn(n, v, generator=generator), -1)
    logprobs, ids = teacher.topk(k, -1)
    return logits, ids, logprobs, teacher


def test_forward_kl_gradient_is_m_q_minus_p_not_q_minus_p():
    logits, ids, logprobs, _ = _inputs()
    x = logits.double().requires_grad_()
    loss, metrics = vocab_parallel_distill_loss(x, ids, logprobs, loss_type="forward_kl", tp_group=None)
    loss.sum().backward()
    q = torch.softmax(logits.double(), -1)
    p = torch.zeros_like(q).scatter(1, ids, logprobs.double().exp())
    mass = p.sum(-1, keepdim=True)
    torch.testing.assert_close(x.grad, mass * q - p, rtol=1e-12, atol=1e-12)
    assert (mass < 0.99).all()  # so Q - P would have been measurably wrong
    torch.testing.assert_close(metrics["teacher_mass"], mass.squeeze(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["student_mass"], q.gather(1, ids).sum(-1), rtol=1e-12, atol=1e-12)


def test_topk_overlap_only_when_asked_and_matches_loop():
    logits, ids, logprobs, _ = _inputs(seed=3)
    _, plain = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="forward_kl", tp_group=None)
    assert "topk_overlap" not in plain
    logprobs[0, 3:] = float("-inf")  # padded entries do not count
    _, metrics = vocab_parallel_distill_loss(
        logits, ids, logprobs, loss_type="forward_kl", tp_group=None, diagnostics=True
    )
    student_top = logits.topk(ids.shape[1], -1).indices
    for row in range(ids.shape[0]):
        valid = [i for i, lp in zip(ids[row].tolist(), logprobs[row].tolist()) if lp > -math.inf]
        expected = len(set(valid) & set(student_top[row].tolist())) / len(valid)
        assert metrics["topk_overlap"][row].item() == pytest.approx(expected)


def test_vocab_parallel_topk_tp1_matches_torch_topk():
    logits, *_ = _inputs()
    ids, values = vocab_parallel_topk(logits.reshape(2, 5, -1), 7, None)
    expected = logits.topk(7, -1)
    assert torch.equal(ids.reshape(10, 7), expected.indices)
    assert torch.equal(values.reshape(10, 7), expected.values)


def test_loss_and_gradient_dtypes():
    logits, ids, logprobs, _ = _inputs()
    x = logits.bfloat16().requires_grad_()
    loss, metrics = vocab_parallel_distill_loss(x, ids, logprobs, loss_type="jsd", tp_group=None)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert all(not m.requires_grad for m in metrics.values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "forwardkl"}, "did you mean 'forward_kl'"),
        ({"loss_type": "jsd", "betta": 0.2}, "did you mean 'beta'"),
        ({"loss_type": "jsd", "beta": 1.0}, "beta=1.0"),
        ({"loss_type": "kl_rkl", "rkl_ratio": 1.5}, "rkl_ratio"),
        ({"loss_type": "tcad", "divergence": "tv"}, "divergence='tv'"),
        ({"loss_type": "tcad", "coverage_coef": -1.0}, "coverage_coef"),
        ({"loss_type": "forward_kl", "temperature": 0.0}, "temperature"),
    ],
)
def test_user_mistakes_raise_value_error_naming_the_key(kwargs, message):
    logits, ids, logprobs, _ = _inputs()
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        vocab_parallel_distill_loss(logits, ids, logprobs, tp_group=None, **kwargs)


@pytest.mark.parametrize("corrupt, message", [
    (lambda ids, lp: lp.__setitem__((0, 0), float("nan")), "NaN"),
    (lambda ids, lp: lp.__setitem__((0, 0), 3.0), "positive"),
    (lambda ids, lp: ids.__setitem__((0, 0), 40), "outside"),
    (lambda ids, lp: ids.__setitem__((0, 0), -2), "outside"),
])
def test_malformed_teacher_output_is_an_error_not_a_silent_zero(corrupt, message):
    logits, ids, logprobs, _ = _inputs()
    corrupt(ids, logprobs)
    with pytest.raises(ValueError, match=message):
        vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="forward_kl", tp_group=None)


def test_shape_mismatch_is_an_error():
    logits, ids, logprobs, _ = _inputs()
    with pytest.raises(ValueError, match="leading dimensions"):
        vocab_parallel_distill_loss(logits[:5], ids, logprobs, loss_type="forward_kl", tp_group=None)


def test_padding_ids_are_ignored_whatever_their_value():
    """Padding ids equal to 0 (local index 0) or past the vocabulary must not touch the result."""
    logits, ids, logprobs, _ = _inputs()
    logprobs[:, 4:] = float("-inf")
    results = []
    for pad in (0, -1, 10_000):
        ids_padded = ids.clone()
        ids_padded[:, 4:] = pad
        x = logits.double().requires_grad_()
        loss, _ = vocab_parallel_distill_loss(x, ids_padded, logprobs, loss_type="forward_kl", tp_group=None)
        loss.sum().backward()
        results.append((loss.detach(), x.grad))
    expected = reference_distill_loss(logits.double(), ids[:, :4], logprobs[:, :4], "forward_kl")
    for loss, grad in results:
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)


def test_registry_names_and_options():
    assert get_divergence("tcad").build_options({}).coverage_coef == 1.0
    with pytest.raises(ValueError, match="registered"):
        get_divergence("nope")


def test_inert_option_is_warned_once(caplog):
    from megatron_gkd.losses import registry

    registry._warned_inert.discard(("tcad", "alpha"))
    logits, ids, logprobs, _ = _inputs()
    with caplog.at_level("WARNING", logger="megatron_gkd.losses.registry"):
        for _ in range(2):
            vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="tcad", tp_group=None, alpha=0.2)
    assert [r.getMessage() for r in caplog.records if "'alpha' has no effect" in r.getMessage()] != []
    assert len([r for r in caplog.records if "alpha" in r.getMessage()]) == 1
