"""Registry of divergences on the teacher's support, chosen by the ``loss_type`` string.

A divergence sees only ``[N, K]`` tensors: the student's tempered logits at the teacher's ids, the
teacher's log-probs there, the validity mask and the student's full-vocabulary log-partition ``L``.
Every loss in this package has the form ``f(z_S, L)`` with ``f`` *linear* in ``L``, so its gradient
with respect to the full logit row is ``lse_coef * softmax(z) + grad_support`` scattered onto ``S``.
That is what lets the vocab-parallel function write the whole gradient in one pass over the shard.

Adding a loss::

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class MyOptions:
        gamma: float = 1.0

    @register_divergence("my_loss", options=MyOptions)
    def my_loss(support: SupportInputs, options: MyOptions) -> SupportTerms:
        ...

and its float64 reference (``@reference_divergence("my_loss")`` in :mod:`.reference`): every test that checks the
divergences against their references picks a registered name up by itself. ``dense=`` (its form over the whole
vocabulary, :mod:`.dense`) and ``cross_tokenizer=True`` (its cross-tokenizer forms) are optional.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from megatron_gkd.registry import Registry, closest

logger = logging.getLogger(__name__)
_warned_inert: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True, slots=True)
class SupportInputs:
    """What a divergence sees; all float tensors in the compute dtype (fp32, or fp64 for fp64 inputs).

    Attributes:
        student_logits: ``[N, K]`` tempered student logits ``z = logits / T`` at the teacher ids
            (0 where ``valid`` is false).
        teacher_logprobs: ``[N, K]`` teacher log-probs; ``-inf`` where ``valid`` is false.
        valid: ``[N, K]`` bool, false for padding entries.
        student_lse: ``[N]`` ``logsumexp`` of ``z`` over the full vocabulary.
    """

    student_logits: torch.Tensor
    teacher_logprobs: torch.Tensor
    valid: torch.Tensor
    student_lse: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class SupportTerms:
    """A divergence's value and exact gradient, split into the support part and the ``L`` part.

    Attributes:
        loss: ``[N]`` per-token loss.
        grad_support: ``[N, K]`` partial derivative of ``loss`` with respect to ``student_logits``
            holding ``student_lse`` fixed (0 at invalid entries).
        lse_coef: ``[N]`` partial derivative of ``loss`` with respect to ``student_lse``; the full
            gradient on vocabulary entry ``i`` is ``lse_coef * softmax(z)_i + grad_support`` on ``S``.
    """

    loss: torch.Tensor
    grad_support: torch.Tensor
    lse_coef: torch.Tensor


DivergenceFn = Callable[[SupportInputs, Any], SupportTerms]


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """A registered divergence: its name, its function, the dataclass of its options and what it needs (the config
    checks and the trainer ask these, never the name).

    An options dataclass may define ``inert_keys(given: dict) -> list[str]``: options that were passed
    but have no effect; they are logged as a warning once per process.

    Attributes:
        student_support: its support holds the student's own top-k ids of each sampled response beside the teacher's
            (TCAD, :mod:`.tcad`), which the teacher scores as requested ids: it needs on-policy samples with the
            rollout's top-k ids (``rollout.logprobs_k``) and a teacher that scores requested ids, it has no
            cross-tokenizer form, and its options carry ``coverage_coef`` (the student's mass outside the support).
        cross_tokenizer: it has a cross-tokenizer form (:mod:`.cross_vocab`, fused and over the whole vocabulary):
            a teacher of another tokenizer can be distilled with it.
        dense: its form over the whole vocabulary (``teacher.signal=hidden``), one streamed pass over the logit
            shards: a function of its built options returning a :class:`~megatron_gkd.losses.dense.DenseDivergence`;
            None where it has none (the hidden signal is refused with it).
    """

    name: str
    fn: DivergenceFn
    options_cls: type
    student_support: bool = False
    cross_tokenizer: bool = False
    dense: Callable[[Any], Any] | None = None

    def build_options(self, options: dict[str, Any]) -> Any:
        """Instantiates this divergence's options, naming any unknown key and the closest valid one.

        Raises:
            ValueError: an option is unknown to this divergence or has an invalid value.
        """
        valid = [field.name for field in dataclasses.fields(self.options_cls)]
        for key in options:
            if key not in valid:
                raise ValueError(
                    f"loss_type={self.name!r} has no option {key!r}{closest(key, valid)} "
                    f"(its options: {', '.join(valid) or 'none'})"
                )
        built = self.options_cls(**options)
        inert_keys = getattr(self.options_cls, "inert_keys", None)
        for key in inert_keys(options) if inert_keys else []:
            if (self.name, key) not in _warned_inert:  # once per process, not once per micro-batch
                _warned_inert.add((self.name, key))
                logger.warning("loss_type=%r: option %r has no effect with these options %s",
                               self.name, key, options)
        return built


DIVERGENCES: Registry[Divergence] = Registry("divergence", config_key="loss_type")


def register_divergence(name: str, *, options: type, student_support: bool = False, cross_tokenizer: bool = False,
                        dense: Callable[[Any], Any] | None = None) -> Callable[[DivergenceFn], DivergenceFn]:
    """Registers ``fn(support, options) -> SupportTerms`` under ``name``.

    Args:
        name: the ``loss_type`` string that selects it.
        options: a dataclass whose fields are the loss's keyword options (with defaults).
        student_support, cross_tokenizer, dense: what it needs and offers (:class:`Divergence`).
    """

    def decorate(fn: DivergenceFn) -> DivergenceFn:
        DIVERGENCES.register(name, Divergence(name, fn, options, student_support=student_support,
                                              cross_tokenizer=cross_tokenizer, dense=dense))
        return fn

    return decorate


def get_divergence(name: str) -> Divergence:
    """The divergence registered as ``name``.

    Raises:
        ValueError: no divergence has that name (the message lists the registered ones).
    """
    return DIVERGENCES.get(name)


def registered_divergences() -> list[str]:
    """Names of all registered divergences, sorted."""
    return DIVERGENCES.names()


def teacher_support_divergences() -> list[str]:
    """Names of the divergences on the teacher's top-k alone (not :attr:`Divergence.student_support`), sorted: those
    with a tail-bucket form."""
    return [name for name in DIVERGENCES.names() if not DIVERGENCES.get(name).student_support]


def dense_divergences() -> list[str]:
    """Names of the divergences with a form over the whole vocabulary (:attr:`Divergence.dense`), sorted."""
    return [name for name in DIVERGENCES.names() if DIVERGENCES.get(name).dense is not None]


def cross_tokenizer_divergences() -> list[str]:
    """Names of the divergences with a cross-tokenizer form (:attr:`Divergence.cross_tokenizer`), sorted."""
    return [name for name in DIVERGENCES.names() if DIVERGENCES.get(name).cross_tokenizer]
