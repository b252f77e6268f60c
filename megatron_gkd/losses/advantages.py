"""Advantages from group rewards, and the policy-gradient term's aggregation as per-token coefficients.

Pure tensor code, no collectives. Both are chosen by name from registries whose members say what they need
(a group of ``rollout.n >= 2`` samples per prompt, a constant normaliser), so the config checks ask them instead of
comparing names.

Advantage estimators (``rewards``: ``[num_prompts, n]``, one row per prompt group; ``mean``/``std`` over the row):

=============  =====================================================  ==========  ===========================
name           advantage of sample ``i``                              needs       source
=============  =====================================================  ==========  ===========================
``grpo``       ``(r_i - mean) / (std + eps)``, ``std`` with Bessel's  ``n >= 2``  DeepSeekMath (GRPO)
               correction (as TRL and verl compute it)
``rloo``       ``r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean)``  ``n >= 2``  Ahmadian et al. (RLOO)
``dr_grpo``    ``r_i - mean`` (no std scaling: no bias towards        ``n >= 2``  Liu et al. (Dr. GRPO)
               groups of nearly equal rewards)
``reinforce``  ``r_i`` (no baseline; e.g. reward 0 and the teacher    ``n >= 1``  Williams (REINFORCE)
               as the only signal, through the advantage side)
=============  =====================================================  ==========  ===========================

Aggregation. The policy-gradient term is per token, neither masked nor averaged, like the divergences: the trainer
weighs each token by a coefficient fixed over the *whole global batch* before it is cut into micro-batches and
data-parallel ranks (``megatron_gkd.trainer.batch.token_coefficients``). Every aggregation below is such a
coefficient: it depends only on the token's own sequence length and on counts of the global batch
(:class:`BatchCounts`), so ``sum(coefficient x loss)`` over any split of the batch adds up to the same loss and
gradients. With ``S`` sequences, ``T`` loss tokens in all, ``R_i`` in sequence ``i``:

==================  =================================  ====================================================
name                coefficient of a token of ``i``    the step's loss
==================  =================================  ====================================================
``token_mean``      ``1 / T``                          mean over every token of the batch (DAPO)
``sequence_mean``   ``1 / (S R_i)``                    mean over sequences of each one's token mean (GRPO)
``group_constant``  ``1 / (S L)``, ``L`` =             each group's token sum over the constant ``n L``,
                    ``max_response_len``               mean over groups (Dr. GRPO: no length bias)
==================  =================================  ====================================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from megatron_gkd.registry import Registry

DEFAULT_EPS = 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class AdvantageEstimator:
    """A registered advantage estimator.

    Attributes:
        name: the name that selects it.
        min_group_size: fewest samples per prompt it is defined for (a baseline from the group needs 2).
        fn: ``fn(rewards [num_prompts, n] float64, eps) -> advantages [num_prompts, n]``.
    """

    name: str
    min_group_size: int
    fn: Callable[[torch.Tensor, float], torch.Tensor]


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", config_key="rl.advantage")


def _register_advantage(name: str, min_group_size: int):
    def decorate(fn):
        ADVANTAGE_ESTIMATORS.register(name, AdvantageEstimator(name, min_group_size, fn))
        return fn

    return decorate


@_register_advantage("grpo", min_group_size=2)
def _grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


@_register_advantage("rloo", min_group_size=2)
def _rloo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    # The mean of the others, written out: (sum - r_i) / (n - 1).
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.shape[1] - 1)
    return rewards - others


@_register_advantage("dr_grpo", min_group_size=2)
def _dr_grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)


@_register_advantage("reinforce", min_group_size=1)
def _reinforce(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    return rewards.clone()


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: no estimator has that name (the message names the closest one and lists them all).
    """
    return ADVANTAGE_ESTIMATORS.get(name)


def group_advantages(rewards: torch.Tensor, estimator: str, *, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Per-sample advantages of prompt groups (see the module docstring for each estimator).

    Args:
        rewards: ``[num_prompts, n]`` the rewards of the ``n`` samples of each prompt, finite.
        estimator: ``grpo``, ``rloo``, ``dr_grpo`` or ``reinforce``.
        eps: added to the group's standard deviation (``grpo``): a group of equal rewards gets advantages 0.

    Returns:
        ``[num_prompts, n]`` float64 advantages (the sequence's; every token of a response carries it).

    Raises:
        ValueError: unknown estimator, ``rewards`` not 2-D or not finite, fewer samples per prompt than the
            estimator needs, or advantages that overflow (non-finite from finite rewards).
    """
    chosen = get_advantage_estimator(estimator)
    if rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [num_prompts, n]: one row per prompt group")
    if rewards.shape[1] < chosen.min_group_size:
        raise ValueError(
            f"advantage estimator {estimator!r} needs at least {chosen.min_group_size} samples per prompt (its "
            f"baseline comes from the group), got n={rewards.shape[1]}; sample more per prompt (rollout.n) or use "
            "'reinforce'"
        )
    if not 0 <= eps:
        raise ValueError(f"eps={eps} must be >= 0")
    values = rewards.to(torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("rewards must be finite; a failed reward must fail its sample, not become NaN/inf")
    advantages = chosen.fn(values, eps)
    # Finite rewards can still overflow in a group's sum (two of 1e308): GRPO then gives NaN, RLOO and Dr. GRPO
    # +-inf, which would train silently on garbage.
    finite = torch.isfinite(advantages).all(dim=1)
    if not bool(finite.all()):
        group = int((~finite).nonzero()[0, 0])
        shown = ", ".join(f"{value:g}" for value in values[group, :8].tolist()) + (", ..." if values.shape[1] > 8 else "")
        raise ValueError(f"advantage estimator {estimator!r} gave a non-finite advantage for prompt group {group} of "
                         f"{len(values)} (rewards [{shown}]): the rewards' scale overflows float64; bound them "
                         "(reward.max_abs)")
    return advantages


@dataclasses.dataclass(frozen=True, slots=True)
class BatchCounts:
    """Counts over the whole global batch (summed over data-parallel ranks before the step is cut).

    Attributes:
        num_tokens: loss tokens of every response.
        num_sequences: responses.
        max_response_len: the constant normaliser ``L`` of ``group_constant`` (the generation budget, as Dr. GRPO
            uses); ``None`` when the aggregation does not use it.
    """

    num_tokens: int
    num_sequences: int
    max_response_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.num_sequences < 1:
            raise ValueError(f"a batch needs tokens and sequences, got num_tokens={self.num_tokens}, "
                             f"num_sequences={self.num_sequences}")
        if self.max_response_len is not None and self.max_response_len < 1:
            raise ValueError(f"max_response_len={self.max_response_len} must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class Aggregation:
    """A registered aggregation of the per-token policy-gradient loss (see the module docstring).

    Attributes:
        name: the name that selects it.
        needs_max_response_len: whether it uses :attr:`BatchCounts.max_response_len`.
        coefficient: ``coefficient(response_len, counts) -> float``, every token of that response.
    """

    name: str
    needs_max_response_len: bool
    coefficient: Callable[[int, BatchCounts], float]


AGGREGATIONS: Registry[Aggregation] = Registry("policy-gradient aggregation", config_key="rl.aggregation")
AGGREGATIONS.register("token_mean", Aggregation("token_mean", False, lambda length, c: 1.0 / c.num_tokens))
AGGREGATIONS.register("sequence_mean", Aggregation("sequence_mean", False,
                                                   lambda length, c: 1.0 / (c.num_sequences * length)))
AGGREGATIONS.register("group_constant", Aggregation("group_constant", True,
                                                    lambda length, c: 1.0 / (c.num_sequences * c.max_response_len)))


def get_aggregation(name: str) -> Aggregation:
    """The aggregation registered as ``name``.

    Raises:
        ValueError: no aggregation has that name (the message names the closest one and lists them all).
    """
    return AGGREGATIONS.get(name)


def aggregation_coefficients(
    response_lengths: Sequence[int], aggregation: str, counts: BatchCounts
) -> list[torch.Tensor]:
    """Per response, the ``[R_i]`` float64 coefficients of its tokens in the step's policy-gradient loss.

    Args:
        response_lengths: ``R_i``, the loss tokens of each of this rank's responses (any subset of the batch).
        aggregation: ``token_mean``, ``sequence_mean`` or ``group_constant``.
        counts: the whole global batch's counts, the same on every rank and micro-batch.

    Returns:
        One ``[R_i]`` tensor per response, as ``megatron_gkd.trainer.batch.token_coefficients`` returns them.

    Raises:
        ValueError: unknown aggregation, or ``group_constant`` without ``counts.max_response_len``.
    """
    chosen = get_aggregation(aggregation)
    if chosen.needs_max_response_len and counts.max_response_len is None:
        raise ValueError(f"aggregation {aggregation!r} divides by a constant: set BatchCounts.max_response_len to the "
                         "generation budget (the rollout's maximum response length)")
    return [torch.full((length,), chosen.coefficient(length, counts) if length else 0.0, dtype=torch.float64)
            for length in response_lengths]
