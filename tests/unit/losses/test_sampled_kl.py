"""Sampled-token KL estimators (exact in expectation) and the rollout-trainer mismatch metrics."""

import math

import pytest
import torch

from megatron_gkd.losses import reverse_kl_estimate, rollout_mismatch
from megatron_gkd.testing.policy_gradient import check_mismatch


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_estimators_are_unbiased_for_the_reverse_kl(estimator):
    """Averaged over every token weighted by the student's probability (the exact expectation over its samples),
    each estimator gives KL(student || teacher); k3 is never negative on a single token."""
    generator = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(5, 11, generator=generator, dtype=torch.float64), -1)
    teacher = torch.log_softmax(torch.randn(5, 11, generator=generator, dtype=torch.float64), -1)
    per_token = reverse_kl_estimate(student, teacher, estimator)
    expectation = (student.exp() * per_token).sum(-1)
    exact = (student.exp() * (student - teacher)).sum(-1)
    torch.testing.assert_close(expectation, exact, rtol=0, atol=1e-12)
    if estimator == "k3":
        assert bool((per_token >= 0).all())
    else:
        assert bool((per_token < 0).any())  # k1 is unbiased but not a per-token bound


def test_estimator_errors():
    with pytest.raises(ValueError, match="did you mean 'k3'"):
        reverse_kl_estimate(torch.zeros(3), torch.zeros(3), "k_3")
    with pytest.raises(ValueError, match="same shape"):
        reverse_kl_estimate(torch.zeros(3), torch.zeros(4))


def test_rollout_mismatch_on_one_rank():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -9.0]])
    behaviour = torch.tensor([[-1.2, -1.5, -0.5], [-3.0, -0.3, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the last token is padding: ignored
    found = rollout_mismatch(train, behaviour, mask)
    log_ratio = torch.tensor([0.2, -0.5, 0.0, 0.0, 0.2], dtype=torch.float64)
    assert found["num_tokens"].item() == 5
    assert found["max_ratio"].item() == pytest.approx(math.exp(0.2))
    assert found["min_ratio"].item() == pytest.approx(math.exp(-0.5))
    assert found["kl_k1"].item() == pytest.approx(float((-log_ratio).mean()))
    assert found["kl_k3"].item() == pytest.approx(float((log_ratio.exp() - 1 - log_ratio).mean()))
    assert all(error < 1e-12 for error in check_mismatch(None).values())


def test_rollout_mismatch_without_tokens_is_nan():
    found = rollout_mismatch(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    assert found["num_tokens"].item() == 0
    assert all(math.isnan(found[key].item()) for key in ("kl_k1", "kl_k3", "max_ratio", "min_ratio"))


def _expected_advantage_gradient(student_logits: torch.Tensor, teacher: torch.Tensor, estimator: str) -> torch.Tensor:
    """The exact expectation over the student's samples of the policy-gradient loss's gradient with the detached
    ``-k(y)`` as the advantage: ``sum_y pi_s(y) k(y) grad log pi_s(y)`` (float64, every token enumerated)."""
    logits = student_logits.clone().requires_grad_()
    student = torch.log_softmax(logits, -1)
    advantage = -reverse_kl_estimate(student.detach(), teacher, estimator)
    (-(student.detach().exp() * advantage * student).sum()).backward()
    return logits.grad


def test_k1_as_an_advantage_descends_the_reverse_kl_and_k3_does_not():
    """By exact enumeration: k1's expected gradient is grad KL(s || t); k3's is grad KL(s || t) - grad CE(t, s)
    (``E_s[(r - 1) grad log s] = sum_y t(y) grad log s(y) = -grad CE(t, s)``, ``r = t / s``), which is why the
    advantage forms refuse k3 (:class:`~megatron_gkd.config.schema.RLConfig`)."""
    generator = torch.Generator().manual_seed(1)
    student_logits = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(4, 9, generator=generator, dtype=torch.float64), -1)
    logits = student_logits.clone().requires_grad_()
    student = torch.log_softmax(logits, -1)
    kl = (student.exp() * (student - teacher)).sum()
    (grad_kl,) = torch.autograd.grad(kl, logits, retain_graph=True)
    (grad_ce,) = torch.autograd.grad(-(teacher.exp() * student).sum(), logits)
    torch.testing.assert_close(_expected_advantage_gradient(student_logits, teacher, "k1"), grad_kl, rtol=0, atol=1e-12)
    k3 = _expected_advantage_gradient(student_logits, teacher, "k3")
    torch.testing.assert_close(k3, grad_kl - grad_ce, rtol=0, atol=1e-12)
    assert (k3 - grad_kl).abs().max() > 0.1  # not a rounding: the bias is of the gradient's own size
