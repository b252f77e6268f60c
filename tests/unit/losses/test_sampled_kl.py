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
