"""The ``loss`` and ``rl`` sections of the configuration, beside the losses they choose (composed into
:class:`~megatron_gkd.config.GKDConfig` as the teacher's, the data's and the weight sync's sections are). Each
validates itself: the divergence and its options (:mod:`.registry`), the combination of reward and teacher
(:mod:`.combinations`), the advantage estimator and aggregation (:mod:`.advantages`), the per-token KL estimator
(:mod:`.sampled_kl`) and the policy-gradient loss's options (:mod:`.policy_gradient`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron_gkd.losses.advantages import get_advantage_estimator, get_aggregation
from megatron_gkd.losses.combinations import get_combination
from megatron_gkd.losses.policy_gradient import PolicyGradientOptions
from megatron_gkd.losses.registry import Divergence, get_divergence, teacher_support_divergences
from megatron_gkd.losses.sampled_kl import KL_ESTIMATORS, check_advantage_estimator


@dataclasses.dataclass(kw_only=True, slots=True)
class LossConfig:
    """The distillation loss (``on_policy`` / ``off_policy`` modes; ``sft`` uses cross-entropy)."""

    type: str = "forward_kl"
    """Registered divergence: ``forward_kl``, ``reverse_kl``, ``jsd``, ``kl_rkl`` or ``tcad``."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The divergence's options: ``beta`` (jsd), ``rkl_ratio`` (kl_rkl), ``divergence`` / ``alpha`` /
    ``coverage_coef`` (tcad)."""
    temperature: float = 1.0
    """Student distribution ``softmax(logits / temperature)``."""
    confidence_alpha: float | None = None
    """Teacher-confidence reweighting of each prompt's ``n`` responses (TCAD): weights
    ``softmax(alpha * (c_i - mean c))`` within the group, ``c_i`` the teacher's mean log-prob of response
    i. ``None``: every response token counts the same (token mean)."""
    support_k: int | None = None
    """tcad: width of the support-symmetric truncation of teacher and student top-k; default ``teacher.top_k``."""
    support_mode: str = "interleave"
    """tcad: ``interleave`` (truncated to ``support_k``) or ``union`` of both top-k lists."""
    fused: bool = False
    """Fused output layer + loss, chunked over tokens: the ``[s, b, V/tp]`` logits never exist."""
    chunk_size: int = 1024
    """Tokens per chunk of the fused path."""
    diagnostics: bool = False
    """Also measure the teacher/student top-k overlap (an extra vocab-parallel top-k; unfused only)."""
    tail_bucket: bool = False
    """Top-k teacher rows: compare over ``k+1`` outcomes, the teacher's ids and the mass outside them on both sides
    (:mod:`megatron_gkd.losses.tail`): every divergence is then a true divergence, and reverse KL / JSD no longer
    renormalise on the top-k. One more number per token; not with ``tcad`` (its coverage term scores that mass)."""

    def __post_init__(self):
        divergence = get_divergence(self.type)
        try:
            divergence.build_options(dict(self.options))
        except ValueError as error:
            raise ValueError(f"loss.options: {error}") from None
        if not self.temperature > 0:
            raise ValueError(f"loss.temperature={self.temperature} must be > 0")
        if self.support_mode not in ("interleave", "union"):
            raise ValueError(f"loss.support_mode={self.support_mode!r}; choose 'interleave' or 'union'")
        if self.support_k is not None and self.support_k < 1:
            raise ValueError(f"loss.support_k={self.support_k} must be >= 1 (or null for teacher.top_k)")
        if self.chunk_size < 1:
            raise ValueError(f"loss.chunk_size={self.chunk_size} must be >= 1")
        if self.tail_bucket and divergence.student_support:
            raise ValueError(f"loss.tail_bucket=true does not apply to loss.type={self.type}: its coverage term "
                             "(loss.options.coverage_coef) already scores the student's mass outside its support; "
                             "set loss.tail_bucket=false, or a divergence on the teacher's top-k "
                             f"({', '.join(teacher_support_divergences())})")
        if self.fused and self.diagnostics:
            raise ValueError("loss.diagnostics needs the full logits, which loss.fused=true never builds; "
                             "turn one of them off")

    @property
    def divergence(self) -> Divergence:
        """The registered :class:`~megatron_gkd.losses.registry.Divergence` of ``type`` (what it needs and offers)."""
        return get_divergence(self.type)



@dataclasses.dataclass(kw_only=True, slots=True)
class RLConfig:
    """The policy-gradient term: the student trains on its samples' rewards with the teacher's signal
    (:mod:`megatron_gkd.losses.combinations`). Null ``combine``: no policy gradient, the loss is the divergence."""

    combine: str | None = None
    """``loss`` (``pg + kd_coef x divergence``; ``kd_coef: 0`` is reward only), ``advantage`` (``A_t = A_reward -
    kd_coef x k(y_t)``, the teacher's log-prob of the sampled token only) or ``teacher`` (reward 0, ``A_t = -kd_coef x
    k(y_t)``); null: distillation only."""
    kd_coef: float = 1.0
    """The teacher's weight in the combination, ``>= 0`` (at the first batch, with ``kd_coef_end``)."""
    kd_coef_end: float | None = None
    """KDRL's annealing: the teacher's weight moves linearly from ``kd_coef`` to this value over the first
    ``kd_coef_steps`` batches and stays there (``kd_coef: 1``, ``kd_coef_end: 0``: distillation that anneals into
    rewards alone); null: ``kd_coef`` throughout."""
    kd_coef_steps: int | None = None
    """Batches over which ``kd_coef`` reaches ``kd_coef_end``."""
    advantage: str = "grpo"
    """Advantage from each prompt's rewards: ``grpo``, ``rloo``, ``dr_grpo`` (need ``rollout.n >= 2``) or
    ``reinforce``."""
    aggregation: str = "token_mean"
    """How the per-token policy-gradient loss is averaged: ``token_mean``, ``sequence_mean`` or ``group_constant``
    (divides by ``rollout.max_tokens``)."""
    kl_estimator: str = "k1"
    """The per-token estimate of ``KL(student || teacher)`` in the advantage: ``k1`` (``k3``, unbiased for the KL's
    value, is refused there: its gradient as an advantage is biased, :mod:`megatron_gkd.losses.sampled_kl`)."""
    clip_low: float = 0.2
    """PPO's ratio clip below (``1 - clip_low``). The ratio is ``pi / pi_old``, ``pi_old`` the trainer's log-probs of the
    samples before the batch's first update: with one update per batch (``ppo_epochs = mini_batches = 1``) it is 1 and
    the clip is inert; with several it acts from the second update on."""
    clip_high: float = 0.2
    """PPO's ratio clip above (``1 + clip_high``)."""
    clip_ratio_c: float | None = None
    """Dual clip for negative advantages (``> 1``); null: off."""
    tis_cap: float | None = None
    """Truncated importance sampling: each token's policy-gradient loss is weighted by ``min(pi_train / pi_rollout,
    tis_cap)`` (the rollout engine's log-probs; needs ``rollout.temperature=1``, the engine reports raw
    log-probs). Null: off; the mismatch is still logged (``mismatch/*``)."""
    advantage_eps: float = 1e-6
    """Added to the group's standard deviation (``grpo``)."""
    teacher_baseline: bool = False
    """The advantage forms: each token's ``k1`` less a baseline, the mean ``k1`` of the other samples of its prompt group
    at the same position (0 where none reaches it), from the sampler's log-probs (needs ``rollout.temperature=1`` and
    ``rollout.n >= 2``): ``A_t = A_reward - kd_coef x (k1(y_t) - b_t)``. The others' samples do not depend on this
    token, so the expected gradient is unchanged; the variance falls where ``k1`` is large at every position."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (:mod:`megatron_gkd.trainer.dynamic_sampling`): prompt groups whose ``rollout.n`` rewards
    are all equal (no reward advantage under ``grpo``, ``rloo``, ``dr_grpo``) are dropped before the teacher is asked,
    and more prompts are drawn and sampled until the batch holds ``global_batch_size / rollout.n`` groups whose rewards
    differ, or ``dynamic_sampling_max_rounds`` extra rounds are spent (the rest of the batch is then groups of equal
    rewards, in the order drawn, logged as ``rl/dynamic_groups_short``)."""
    dynamic_sampling_max_rounds: int = 4
    """Extra sampling rounds a batch may take after its first (``dynamic_sampling``); 0: no refill, the batch is its
    first draw's groups and only the metrics say how many carried no reward advantage."""
    ppo_epochs: int = 1
    """Passes over each batch (PPO's epochs), each of ``mini_batches`` optimizer steps. With more than one update per
    batch the trainer first records the sampled tokens' log-probs (``pi_old``: a forward pass without gradients, as
    verl's and NeMo-RL's actors do), the ratio of every update is taken against them and the advantages (the
    teacher's ``k(y_t)`` included) stay those of ``pi_old``. The learning-rate schedule steps once per batch."""
    mini_batches: int = 1
    """Optimizer steps per pass: the batch's micro-batches on each rank in this many consecutive groups (each rank
    needs at least as many micro-batches); a group's gradient is scaled by ``mini_batches``, so that it weighs as a
    whole batch's."""

    def __post_init__(self):
        if self.combine is not None:
            get_combination(self.combine)
        get_advantage_estimator(self.advantage)
        get_aggregation(self.aggregation)
        KL_ESTIMATORS.get(self.kl_estimator)
        if self.combine is not None and self.combination.teacher_in_advantage:
            check_advantage_estimator(self.kl_estimator, self.combine)
        try:
            PolicyGradientOptions.of(self.options)
        except ValueError as error:
            raise ValueError(str(error).replace("option ", "rl.", 1)) from None
        if not (self.kd_coef >= 0 and math.isfinite(self.kd_coef)):
            raise ValueError(f"rl.kd_coef={self.kd_coef} must be a finite number >= 0")
        if self.kd_coef_end is not None and not (self.kd_coef_end >= 0 and math.isfinite(self.kd_coef_end)):
            raise ValueError(f"rl.kd_coef_end={self.kd_coef_end} must be a finite number >= 0 (or null: no schedule)")
        if self.kd_coef_end is not None and not (self.kd_coef_steps or 0) >= 1:
            raise ValueError(f"rl.kd_coef_end needs rl.kd_coef_steps >= 1 (the batches of the ramp), not "
                             f"{self.kd_coef_steps}")
        if self.kd_coef_end is None and self.kd_coef_steps is not None:
            raise ValueError("rl.kd_coef_steps has no effect without rl.kd_coef_end: set rl.kd_coef_end (the weight "
                             "at the end of the ramp) or rl.kd_coef_steps=null")
        if not self.advantage_eps >= 0:
            raise ValueError(f"rl.advantage_eps={self.advantage_eps} must be >= 0")
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(f"rl.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} must be >= 0 (extra "
                             "sampling rounds after a batch's first; 0: none)")
        for key in ("ppo_epochs", "mini_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"rl.{key}={getattr(self, key)} must be >= 1 (1: one update per batch)")

    @property
    def enabled(self) -> bool:
        """The step has a policy-gradient term."""
        return self.combine is not None

    @property
    def combination(self):
        """The :class:`~megatron_gkd.losses.combinations.Combination` of ``combine`` (None without one)."""
        return get_combination(self.combine) if self.combine is not None else None

    def kd_coef_at(self, step: int) -> float:
        """The teacher's weight at batch ``step`` (0-based) under ``kd_coef_end``'s linear ramp."""
        if self.kd_coef_end is None:
            return self.kd_coef
        progress = min(max(step, 0) / self.kd_coef_steps, 1.0)
        return self.kd_coef + (self.kd_coef_end - self.kd_coef) * progress

    @property
    def num_updates(self) -> int:
        """Optimizer steps per batch (``ppo_epochs x mini_batches``)."""
        return self.ppo_epochs * self.mini_batches

    @property
    def options(self) -> dict:
        """The clipping and importance-sampling options of the policy-gradient loss."""
        return {"clip_low": self.clip_low, "clip_high": self.clip_high, "clip_ratio_c": self.clip_ratio_c,
                "tis_cap": self.tis_cap}
