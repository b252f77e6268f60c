"""Advantage estimators against their definitions, and aggregations as per-token coefficients that make the
step's policy-gradient loss independent of how the batch is split."""

import pytest
import torch

from megatron_gkd.losses.advantages import (
    BatchCounts,
    aggregation_coefficients,
    get_advantage_estimator,
    get_aggregation,
    group_advantages,
)

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]])


def _by_loops(rewards: torch.Tensor, estimator: str) -> torch.Tensor:
    """Each definition written sample by sample."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for p, row in enumerate(rewards.double()):
        n = len(row)
        mean = sum(row) / n
        std = (sum((r - mean) ** 2 for r in row) / (n - 1)) ** 0.5
        for i, r in enumerate(row):
            others = [row[j] for j in range(n) if j != i]
            out[p, i] = {"grpo": (r - mean) / (std + 1e-6), "rloo": r - sum(others) / (n - 1),
                         "dr_grpo": r - mean, "reinforce": r}[estimator]
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "reinforce"])
def test_estimators_match_their_definitions(estimator):
    found = group_advantages(REWARDS, estimator)
    assert found.dtype == torch.float64 and found.shape == REWARDS.shape
    torch.testing.assert_close(found, _by_loops(REWARDS, estimator), rtol=0, atol=1e-12)
    if estimator != "reinforce":
        assert found[1].abs().max() == 0  # equal rewards: no signal, and no NaN from a zero std


def test_estimators_that_need_a_group_refuse_one_sample_per_prompt():
    for estimator in ("grpo", "rloo", "dr_grpo"):
        assert get_advantage_estimator(estimator).min_group_size == 2
        with pytest.raises(ValueError, match="at least 2 samples per prompt.*rollout.n"):
            group_advantages(REWARDS[:, :1], estimator)
    torch.testing.assert_close(group_advantages(REWARDS[:, :1], "reinforce"), REWARDS[:, :1].double())


def test_advantage_errors_name_the_problem():
    with pytest.raises(ValueError, match="did you mean 'rloo'"):
        group_advantages(REWARDS, "rlo")
    with pytest.raises(ValueError, match=r"\[num_prompts, n\]"):
        group_advantages(REWARDS.reshape(-1), "grpo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]), "grpo")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "reinforce"])
def test_finite_rewards_whose_advantages_overflow_are_refused_not_turned_into_nan(estimator):
    """1e308 is finite, but a group's sum of two is inf: GRPO gave NaN, RLOO and Dr. GRPO +-inf, silently."""
    rewards = torch.tensor([[0.0, 1.0], [1e308, 1.7e308]], dtype=torch.float64)
    if estimator == "reinforce":  # no arithmetic on the group: the rewards themselves, finite
        torch.testing.assert_close(group_advantages(rewards, estimator), rewards)
        return
    with pytest.raises(ValueError, match=rf"advantage estimator {estimator!r} gave a non-finite advantage for "
                                         r"prompt group 1 of 2 \(rewards \[1e\+308, 1\.7e\+308\]\)"):
        group_advantages(rewards, estimator)


LENGTHS = [3, 7, 1, 5, 4, 4, 2, 6]  # 8 responses: 2 groups of n = 4
LOSSES = [torch.linspace(-1.0, 2.0, length, dtype=torch.float64) * (i + 1) for i, length in enumerate(LENGTHS)]


def _definition(aggregation: str, max_response_len: int) -> float:
    """The step's loss by each aggregation's definition."""
    if aggregation == "token_mean":
        return float(torch.cat(LOSSES).mean())
    if aggregation == "sequence_mean":
        return float(torch.stack([loss.mean() for loss in LOSSES]).mean())
    groups = [LOSSES[:4], LOSSES[4:]]  # each group's token sum over n L, mean over groups
    return sum(float(sum(loss.sum() for loss in group)) / (4 * max_response_len) for group in groups) / len(groups)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "group_constant"])
def test_aggregations_give_their_loss_whatever_the_split(aggregation):
    counts = BatchCounts(num_tokens=sum(LENGTHS), num_sequences=len(LENGTHS), max_response_len=8)
    expected = _definition(aggregation, 8)
    whole = aggregation_coefficients(LENGTHS, aggregation, counts)
    assert [len(c) for c in whole] == LENGTHS and all(c.dtype == torch.float64 for c in whole)
    assert float(sum((c * loss).sum() for c, loss in zip(whole, LOSSES))) == pytest.approx(expected, rel=1e-14)
    # Two data-parallel ranks of two micro-batches each, every piece with the global counts.
    pieces = [[0, 5], [2], [1, 3, 7], [4, 6]]
    split = 0.0
    for piece in pieces:
        coefficients = aggregation_coefficients([LENGTHS[i] for i in piece], aggregation, counts)
        split += float(sum((c * LOSSES[i]).sum() for c, i in zip(coefficients, piece)))
    assert split == pytest.approx(expected, rel=1e-14)


def test_aggregation_errors_name_the_problem():
    counts = BatchCounts(num_tokens=10, num_sequences=2)
    assert get_aggregation("group_constant").needs_max_response_len
    assert not get_aggregation("token_mean").needs_max_response_len
    with pytest.raises(ValueError, match="max_response_len"):
        aggregation_coefficients([4, 6], "group_constant", counts)
    with pytest.raises(ValueError, match="did you mean 'sequence_mean'"):
        aggregation_coefficients([4, 6], "sequence_means", counts)
    with pytest.raises(ValueError, match="num_tokens"):
        BatchCounts(num_tokens=0, num_sequences=2)
