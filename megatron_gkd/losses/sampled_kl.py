"""KL estimates from the log-probs of sampled tokens only (no distribution is needed beyond the sampled id).

For a token ``y`` sampled from ``q`` and another model ``p`` with ``log r = log p(y) - log q(y)``, Schulman's
estimators of ``KL(q || p) = E_q[log q - log p]`` are

* ``k1 = -log r``: unbiased, but negative on single tokens (high variance);
* ``k3 = (r - 1) - log r``: unbiased and never negative (``E_q[r] = 1``), lower variance when ``p`` is close.

Unbiased for the KL's *value*, not for its gradient: used as a (detached) per-token advantage, ``-k`` gives the
policy-gradient loss the expected gradient ``E_q[k grad log q]``, which is ``grad KL(q || p)`` for k1 but
``grad KL(q || p) - grad CE(p, q)`` for k3 (its ``r - 1`` term contributes ``E_q[r grad log q] = sum_y p(y) grad log
q(y) = -grad CE(p, q)``, while ``E_q[grad log q] = 0``): descending it raises the forward KL. Each estimator says
whether it may be an advantage (:attr:`KLEstimator.gradient_as_advantage`); k3 stays for the mismatch figures.

Two uses in RL with distillation:

* The student samples and the teacher scores: ``reverse_kl_estimate`` is a per-token estimate of the reverse
  KL ``KL(student || teacher)``, for the advantage-side combination ``A_t = A_reward - kd_coef x estimate`` and
  for the teacher-only form (reward 0). There it is an advantage: the caller detaches it.
* The rollout engine samples and the trainer recomputes: :func:`rollout_mismatch` measures how far the trainer's
  log-probs of the same tokens are from the sampler's (numerics, kernels, stale weights), logged every step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gkd.registry import Registry


@dataclasses.dataclass(frozen=True, slots=True)
class KLEstimator:
    """A per-token estimator of ``KL(q || p)`` from ``log r = log p(y) - log q(y)``, ``y ~ q``.

    Attributes:
        name: the name that selects it.
        fn: the estimate from ``log r``.
        gradient_as_advantage: ``-fn`` as a detached advantage gives ``grad KL(q || p)`` in expectation (see the
            module docstring: k1 does, k3 does not).
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    gradient_as_advantage: bool


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", config_key="rl.kl_estimator")
KL_ESTIMATORS.register("k1", KLEstimator("k1", lambda log_ratio: -log_ratio, gradient_as_advantage=True))
KL_ESTIMATORS.register("k3", KLEstimator("k3", lambda log_ratio: torch.expm1(log_ratio) - log_ratio,
                                         gradient_as_advantage=False))


def check_advantage_estimator(estimator: str, combine: str) -> None:
    """Refuses an estimator whose detached value is not a gradient-correct advantage (the module docstring).

    Raises:
        ValueError: naming ``rl.kl_estimator`` and the fix.
    """
    if not KL_ESTIMATORS.get(estimator).gradient_as_advantage:
        raise ValueError(
            f"rl.kl_estimator={estimator} with rl.combine={combine!r}: as a per-token advantage {estimator}'s expected "
            "gradient is grad KL(student || teacher) - grad CE(teacher, student), so descending it raises the forward "
            "KL (docs/running.md, 'Training on rewards with the teacher'); set rl.kl_estimator=k1 (unbiased gradient), "
            "or rl.combine=loss for the teacher's divergence as a loss term")


def reverse_kl_estimate(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of ``KL(student || teacher)`` at tokens the student sampled.

    Args:
        student_logprobs: ``[...]`` the student's log-probs of its sampled tokens.
        teacher_logprobs: same shape, the teacher's log-probs of the same tokens.
        estimator: ``k1`` (``log pi_s - log pi_t``) or ``k3`` (``r - 1 - log r``, ``r = pi_t / pi_s``).

    Returns:
        The estimate per token, differentiable through both inputs (detach it to use it as an advantage).

    Raises:
        ValueError: unknown estimator (the message names the closest) or shapes that differ.
    """
    chosen = KL_ESTIMATORS.get(estimator)
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs "
                         f"{tuple(teacher_logprobs.shape)} must have the same shape")
    return chosen.fn(teacher_logprobs - student_logprobs)


def mismatch_sums(
    train_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """This rank's sums behind :func:`rollout_mismatch` over ``mask`` (no collective): 0-dim float64 ``k1`` and
    ``k3`` (sums over the tokens), ``abs`` (the sum of ``|log pi_train - log pi_behaviour|``), ``max_log_ratio`` and
    ``max_inverse_log_ratio`` (the largest ``log pi_train - log pi_behaviour`` and its negation; ``-inf`` without
    tokens) and ``num_tokens``.

    Raises:
        ValueError: shapes that differ.
    """
    if not train_logprobs.shape == behaviour_logprobs.shape == mask.shape:
        raise ValueError(f"train_logprobs {tuple(train_logprobs.shape)}, behaviour_logprobs "
                         f"{tuple(behaviour_logprobs.shape)} and mask {tuple(mask.shape)} must have the same shape")
    mask = mask.bool()
    # k1 and k3 of KL(behaviour || train) take log(p / q) with p the trainer, q the sampler: log_ratio itself.
    log_ratio = train_logprobs.detach().double() - behaviour_logprobs.detach().double()
    zero = torch.zeros_like(log_ratio)
    return {"k1": torch.where(mask, KL_ESTIMATORS.get("k1").fn(log_ratio), zero).sum(),
            "k3": torch.where(mask, KL_ESTIMATORS.get("k3").fn(log_ratio), zero).sum(),
            "abs": torch.where(mask, log_ratio.abs(), zero).sum(),
            "max_log_ratio": torch.where(mask, log_ratio, -torch.inf).max() if mask.numel() else zero.new_tensor(-torch.inf),
            "max_inverse_log_ratio": torch.where(mask, -log_ratio, -torch.inf).max() if mask.numel()
            else zero.new_tensor(-torch.inf),
            "num_tokens": mask.sum().double()}


def rollout_mismatch(
    train_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs of the sampled tokens are from the rollout engine's, over ``mask``.

    ``ratio = pi_train(y) / pi_behaviour(y)`` per token; the KL is ``KL(behaviour || train)``, estimated at the
    sampled tokens (``y ~ behaviour``) with ``k1`` and ``k3``. Two collectives over ``group`` (one sum, one max),
    so every rank of it gets the figures of the whole group's tokens.

    Args:
        train_logprobs: ``[...]`` the trainer's log-probs (detached or not; nothing here is differentiated).
        behaviour_logprobs: same shape, the rollout engine's log-probs of the same tokens.
        mask: same shape, bool, the tokens to count (response tokens).
        group: ranks whose tokens are pooled (e.g. the data-parallel group); ``None``: this rank's only.

    Returns:
        0-dim float64 tensors: ``kl_k1`` and ``kl_k3`` (means over the tokens), ``max_ratio`` and ``min_ratio``
        (over the tokens), ``num_tokens``. With no token counted the figures are NaN (nothing was measured).

    Raises:
        ValueError: shapes that differ.
    """
    local = mismatch_sums(train_logprobs, behaviour_logprobs, mask)
    sums = torch.stack([local["k1"], local["k3"], local["num_tokens"]])
    extremes = torch.stack([local["max_log_ratio"], local["max_inverse_log_ratio"]])  # both maxima: one MAX reduce
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    num_tokens = sums[2]
    nothing = num_tokens == 0
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=sums.device)
    return {
        "kl_k1": torch.where(nothing, nan, sums[0] / num_tokens.clamp(min=1)),
        "kl_k3": torch.where(nothing, nan, sums[1] / num_tokens.clamp(min=1)),
        "max_ratio": torch.where(nothing, nan, extremes[0].exp()),
        "min_ratio": torch.where(nothing, nan, (-extremes[1]).exp()),
        "num_tokens": num_tokens,
    }
