"""What the last stage computes per token: a :class:`LossSpec` per teacher (the divergence on its signal and
vocabulary, or cross-entropy) and the :class:`PolicySpec` of the policy-gradient term, built from the config."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Union

from megatron_gkd.config.schema import LossKind
from megatron_gkd.losses import get_divergence
from megatron_gkd.teacher.protocol.types import Signal
from megatron_gkd.xtok.config import HiddenSupport


def spec_for(specs: "LossSpecs", name: str | None = None) -> "LossSpec":
    """One teacher's spec: ``specs`` is one :class:`LossSpec` for every teacher (and for cross-entropy) or one per
    teacher by name (:func:`loss_specs`); without ``name``, the first teacher's (what the forward captures is the
    same for every teacher)."""
    if isinstance(specs, LossSpec):
        return specs
    return specs[name] if name is not None else next(iter(specs.values()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    """What the last stage computes per token.

    Attributes:
        kind: ``distill`` (a registered divergence against the teacher rows) or ``cross_entropy``.
        loss_type, options, temperature: the divergence, its options and the student temperature.
        fused: the fused output layer + loss (no logits).
        chunk_size: tokens per chunk of the fused path.
        diagnostics: also measure the top-k overlap (unfused).
        tail_bucket: top-k rows: the divergence over the teacher's ids and the mass outside them (``loss.tail_bucket``).
        coverage_coef: tcad's coverage weight, to report the coverage term apart (derived from ``options``).
        signal: ``topk`` (teacher rows of ids and log-probs) or ``hidden`` (the teacher's hidden states: exact
            full-vocabulary divergences through the teacher's output layer, :func:`hidden_distill_loss`).
        teacher_temperature: hidden: the teacher's logits are divided by it.
        real_vocab_size: ids at or past it are padding rows of the tables (the tokenizer is shorter): no
            probability on either side, no gradient, never a teacher id.
        projection: a teacher of another tokenizer: this rank's rows of the map ``W`` (a
            :class:`~megatron_gkd.losses.cross_vocab.projection_map.ProjectionShard`); the teacher rows hold its own vocabulary's
            ids and the divergence is :func:`~megatron_gkd.losses.cross_vocab_distill_loss`. None: the same tokenizer.
        teacher_top_k, teacher_real_vocab_size: a cross-tokenizer teacher's hidden signal: its exact top-k
            (:func:`~megatron_gkd.losses.hidden_topk`, k ids of its vocabulary's first ``teacher_real_vocab_size``) is
            the row compared through ``W``.
        hidden_support: a cross-tokenizer teacher's hidden signal: ``topk`` (the row above) or ``full`` (its exact
            distribution over its whole vocabulary, :func:`~megatron_gkd.losses.hidden_cross_vocab_distill_loss`;
            unfused only: it reads the student's logit shard).
    """

    kind: LossKind = LossKind.DISTILL
    loss_type: str = "forward_kl"
    options: dict = dataclasses.field(default_factory=dict)
    temperature: float = 1.0
    fused: bool = False
    chunk_size: int = 1024
    diagnostics: bool = False
    tail_bucket: bool = False
    signal: Signal = Signal.TOPK
    teacher_temperature: float = 1.0
    real_vocab_size: int | None = None
    projection: object = dataclasses.field(default=None, compare=False)
    teacher_top_k: int | None = None
    teacher_real_vocab_size: int | None = None
    hidden_support: HiddenSupport = HiddenSupport.TOPK
    coverage_coef: float | None = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        for key, choice in (("kind", LossKind), ("signal", Signal), ("hidden_support", HiddenSupport)):
            object.__setattr__(self, key, choice(getattr(self, key)))  # a string is converted
        divergence = get_divergence(self.loss_type) if self.kind.needs_teacher and self.signal.sends_topk else None
        if divergence is not None and divergence.student_support:
            coverage = divergence.build_options(dict(self.options)).coverage_coef
            object.__setattr__(self, "coverage_coef", coverage)
        assert not (self.hidden_support.whole_vocabulary and self.fused), \
            "hidden_support=full reads the student's logits, which the fused path never builds (config checks refuse it)"

    @classmethod
    def from_config(cls, loss, mode, teacher=None, real_vocab_size: int | None = None,
                    projection=None, teacher_real_vocab_size: int | None = None) -> "LossSpec":
        """The spec of ``loss`` in ``mode`` (a :class:`~megatron_gkd.config.schema.Mode`); ``teacher`` (its
        config) chooses the signal; ``projection``, ``teacher_real_vocab_size``: a cross-tokenizer teacher's map
        shard and its tokenizer's size."""
        if not mode.distills:
            return cls(kind=LossKind.CROSS_ENTROPY)
        signal = teacher.signal if teacher is not None else Signal.TOPK
        return cls(loss_type=loss.type, options=dict(loss.options), temperature=loss.temperature, fused=loss.fused,
                   chunk_size=loss.chunk_size, diagnostics=loss.diagnostics, tail_bucket=loss.tail_bucket, signal=signal,
                   teacher_temperature=teacher.temperature if teacher is not None else 1.0,
                   real_vocab_size=real_vocab_size, projection=projection,
                   teacher_top_k=teacher.top_k if projection is not None else None,
                   teacher_real_vocab_size=teacher_real_vocab_size,
                   hidden_support=teacher.cross_tokenizer.hidden_support if projection is not None
                   else HiddenSupport.TOPK)

    def eval_kl(self) -> "LossSpec":
        """The evaluation's forward KL on this spec's teacher signal (top-k rows, or exact from hidden states)."""
        return LossSpec(loss_type="forward_kl", signal=self.signal, teacher_temperature=self.teacher_temperature,
                        real_vocab_size=self.real_vocab_size, fused=self.fused and self.signal.sends_hidden,
                        chunk_size=self.chunk_size, projection=self.projection, teacher_top_k=self.teacher_top_k,
                        teacher_real_vocab_size=self.teacher_real_vocab_size, hidden_support=self.hidden_support)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """The policy-gradient term of the step (``rl``; :mod:`megatron_gkd.losses.combinations`).

    Attributes:
        combination: how the reward and the teacher combine.
        estimator: ``k1`` (the teacher in the advantage; its weight, ``rl.kd_coef`` on its schedule, is each
            micro-batch's ``PolicySlice.kd_coef``).
        options: :class:`~megatron_gkd.losses.PolicyGradientOptions` keywords (clipping, ``tis_cap``).
        temperature: the policy is ``softmax(logits / temperature)``, the rollout's sampling temperature.
        fused, chunk_size: the log-probs from the hidden states and the output weight, as the divergence's.
        real_vocab_size: ids at or past it are padding rows.
        ppo_epochs, mini_batches: passes over a batch and optimizer steps per pass (``rl.ppo_epochs``,
            ``rl.mini_batches``); with more than one update the step records ``pi_old`` first.
    """

    combination: object
    estimator: str = "k1"
    options: dict = dataclasses.field(default_factory=dict)
    temperature: float = 1.0
    fused: bool = False
    chunk_size: int = 1024
    real_vocab_size: int | None = None
    ppo_epochs: int = 1
    mini_batches: int = 1

    @classmethod
    def from_config(cls, config, real_vocab_size: int) -> "PolicySpec | None":
        """The run's term, or None without ``rl.combine``."""
        rl = config.rl
        if not rl.enabled:
            return None
        return cls(combination=rl.combination, estimator=rl.kl_estimator, options=rl.options,
                   temperature=config.rollout.temperature, fused=config.loss.fused, chunk_size=config.loss.chunk_size,
                   real_vocab_size=real_vocab_size, ppo_epochs=rl.ppo_epochs, mini_batches=rl.mini_batches)

    @property
    def num_updates(self) -> int:
        """Optimizer steps per batch."""
        return self.ppo_epochs * self.mini_batches


LossSpecs = Union[LossSpec, Mapping[str, LossSpec]]
"""What the step runs: one :class:`LossSpec` for every teacher (or cross-entropy), or one per teacher by name."""


def loss_specs(loss, mode, teachers, real_vocab_size: int) -> LossSpecs:
    """The loss of ``mode``: one :class:`LossSpec` per teacher by name (one cross-entropy spec where the mode does
    not distil)."""
    if not mode.distills:
        return LossSpec(kind="cross_entropy")
    specs = {}
    for t in teachers:
        cross = getattr(t, "cross", None)
        specs[t.name] = LossSpec.from_config(loss, mode, t.config, real_vocab_size, getattr(t, "projection", None),
                                             None if cross is None else cross.teacher_table.vocab_size)
    return specs
