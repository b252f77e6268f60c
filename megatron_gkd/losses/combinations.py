"""How the teacher's signal and the reward meet in one policy-gradient step (``rl.combine``).

Three forms, each a registered :class:`Combination` that says what it needs, so the trainer and the config checks
ask it instead of comparing names. ``A_r`` is a response's advantage from its group's rewards
(:mod:`.advantages`), ``k(.)`` the per-token estimate of ``KL(student || teacher)`` at the sampled token
(:mod:`.sampled_kl`: ``k1 = log pi_s - log pi_t``; ``k3`` is refused there, its gradient as an advantage is biased),
``c = rl.kd_coef``:

=============  ===========================================================  ==========  =========================
name           per-token loss                                               reward      teacher signal
=============  ===========================================================  ==========  =========================
``loss``       ``pg(A_r) + c x divergence`` (any divergence and signal:     needed      full rows (top-k, TCAD,
               top-k, hidden, TCAD). ``c = 0``: reward only (GRPO)                      hidden)
``advantage``  ``pg(A_r - c x k(y_t))``: the teacher's log-prob of the      needed      the sampled token's
               sampled token only, a dense per-token advantage (slime's                 log-prob
               ``--opd-kl-coef``, verl's OPD with task rewards)
``teacher``    ``pg(-c x k(y_t))``: reward 0, the teacher as the only       not used    the sampled token's
               signal, through the policy gradient (verl's default OPD)                 log-prob
=============  ===========================================================  ==========  =========================

``pg(A)`` is :func:`~megatron_gkd.losses.policy_gradient.policy_gradient_terms`; the KL estimate is an advantage,
so it is computed from detached log-probs and carries no gradient of its own. A baseline ``b_t`` independent of the
token (``rl.teacher_baseline``: the other samples' ``k1`` at its position) may be subtracted from ``k(y_t)``.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_gkd.losses.sampled_kl import check_advantage_estimator, reverse_kl_estimate
from megatron_gkd.registry import Registry


@dataclasses.dataclass(frozen=True, slots=True)
class Combination:
    """A registered form of ``rl.combine``.

    Attributes:
        name: the name that selects it.
        uses_reward: the advantage starts from the group's rewards (a verifier is needed).
        uses_divergence: the teacher's divergence is a loss term, scaled by ``kd_coef``.
        teacher_in_advantage: ``-kd_coef x k(y_t)`` is added to each token's advantage (the teacher's log-prob of
            the sampled token is needed).
    """

    name: str
    uses_reward: bool
    uses_divergence: bool
    teacher_in_advantage: bool


COMBINATIONS: Registry[Combination] = Registry("reward and teacher combination", config_key="rl.combine")
COMBINATIONS.register("loss", Combination("loss", uses_reward=True, uses_divergence=True, teacher_in_advantage=False))
COMBINATIONS.register("advantage", Combination("advantage", uses_reward=True, uses_divergence=False,
                                               teacher_in_advantage=True))
COMBINATIONS.register("teacher", Combination("teacher", uses_reward=False, uses_divergence=False,
                                             teacher_in_advantage=True))


def get_combination(name: str) -> Combination:
    """The combination registered as ``name``.

    Raises:
        ValueError: no combination has that name (the message names the closest one and lists them all).
    """
    return COMBINATIONS.get(name)


def token_advantages(
    combination: Combination,
    reward_advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor | None,
    *,
    kd_coef: float,
    estimator: str = "k1",
    teacher_baseline: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's advantage under ``combination`` (see the module docstring), and the teacher's KL estimate.

    Args:
        combination: the form.
        reward_advantages: ``[...]`` the response's reward advantage at each of its tokens (ignored by ``teacher``).
        student_logprobs: same shape, the student's log-probs of the sampled tokens (detached here).
        teacher_logprobs: same shape, the teacher's log-probs of the same tokens; needed where the teacher is in the
            advantage.
        kd_coef: the teacher's weight ``c``.
        estimator: ``k1`` (``k3`` is refused where the teacher is in the advantage: its gradient is biased there).
        teacher_baseline: same shape, subtracted from the estimate in the advantage (``rl.teacher_baseline``), or None.

    Returns:
        ``(advantages, kl)``: advantages in the dtype of ``student_logprobs``, detached; ``kl`` the per-token estimate
        of ``KL(student || teacher)`` (None where the form does not read the teacher's token log-probs).

    Raises:
        ValueError: the teacher's log-probs are missing, or ``estimator`` is not a gradient-correct advantage.
    """
    dtype = student_logprobs.dtype
    base = torch.zeros_like(student_logprobs) if not combination.uses_reward else reward_advantages.to(dtype)
    if not combination.teacher_in_advantage:
        return base.detach(), None
    if teacher_logprobs is None:
        raise ValueError(f"rl.combine={combination.name!r} needs the teacher's log-prob of each sampled token")
    check_advantage_estimator(estimator, combination.name)
    kl = reverse_kl_estimate(student_logprobs.detach(), teacher_logprobs.to(dtype), estimator).detach()
    signal = kl if teacher_baseline is None else kl - teacher_baseline.to(dtype)
    return (base - kd_coef * signal).detach(), kl
