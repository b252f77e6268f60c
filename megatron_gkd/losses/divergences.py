"""The distillation losses on the teacher's support ``S`` (P = teacher, Q = student).

Each function returns the per-token loss and its exact gradient (see :mod:`.registry` for the split
into a support part and a log-partition part). Rows without any valid support entry (fully padded
teacher rows) get loss 0 and gradient 0.

* ``forward_kl``: ``sum_S P (log P - log Q)``; the teacher is *not* renormalised, so the gradient on
  the full vocabulary is ``m Q - P`` with ``m = sum_S P``.
* ``reverse_kl``: ``KL(Qh || Ph)`` with both renormalised on ``S``.
* ``jsd``: ``beta KL(Ph || M) + (1 - beta) KL(Qh || M)``, ``M = beta Ph + (1 - beta) Qh``.
* ``kl_rkl``: ``(1 - r) forward_kl + r reverse_kl``.
* ``tcad``: a divergence between ``softmax`` of the teacher log-probs on the support ``U`` and
  ``softmax`` of the student logits on ``U``, plus ``coverage_coef (L - logsumexp_U z)``, the student
  mass that leaks outside ``U`` (as a log-ratio).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_gkd.losses import dense
from megatron_gkd.losses.registry import SupportInputs, SupportTerms, register_divergence


def _masked_log_softmax(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-softmax over the valid entries of each row; ``-inf`` elsewhere. Also returns the row lse.

    Rows without valid entries get all ``-inf`` and an lse of 0 (never NaN).
    """
    masked = values.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (masked - lse.unsqueeze(-1)).masked_fill(~valid, float("-inf")), lse


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``KL(p || q)`` of two distributions normalised on the valid entries, and its gradient with
    respect to the logits of ``q`` (``q - p``)."""
    p, q = log_p.exp(), log_q.exp()
    terms = torch.where(valid, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(-1), q - p


def _reverse_kl(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``KL(q || p)`` and its gradient with respect to the logits of ``q``: ``q (a - KL)``,
    ``a = log q - log p``."""
    q = log_q.exp()
    log_ratio = torch.where(valid, log_q - log_p, torch.zeros_like(q))
    loss = (q * log_ratio).sum(-1)
    return loss, q * (log_ratio - loss.unsqueeze(-1))


def _jsd(
    log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised JSD ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``.

    Its derivative with respect to ``q_k`` simplifies to ``h_k = (1 - beta)(log q_k - log m_k)``, so the
    gradient with respect to the logits of ``q`` is ``q (h - sum q h)``.
    """
    p, q = log_p.exp(), log_q.exp()
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    zero = torch.zeros_like(p)
    kl_pm = torch.where(valid, p * (log_p - log_m), zero).sum(-1)
    kl_qm = torch.where(valid, q * (log_q - log_m), zero).sum(-1)
    h = torch.where(valid, (1.0 - beta) * (log_q - log_m), zero)
    grad = q * (h - (q * h).sum(-1, keepdim=True))
    return beta * kl_pm + (1.0 - beta) * kl_qm, grad


def _check_fraction(name: str, value: float, *, open_interval: bool) -> None:
    low_ok = value > 0.0 if open_interval else value >= 0.0
    high_ok = value < 1.0 if open_interval else value <= 1.0
    if not (low_ok and high_ok):
        bounds = "(0, 1)" if open_interval else "[0, 1]"
        raise ValueError(f"option {name}={value} must lie in {bounds}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NoOptions:
    """The loss takes no options."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JSDOptions:
    """Options of ``jsd``.

    Attributes:
        beta: teacher weight of the mixture, in (0, 1); at 0 or 1 the loss is identically zero (use
            ``forward_kl`` / ``reverse_kl`` instead).
    """

    beta: float = 0.5

    def __post_init__(self) -> None:
        _check_fraction("beta", self.beta, open_interval=True)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KLRKLOptions:
    """Options of ``kl_rkl``.

    Attributes:
        rkl_ratio: weight ``r`` of the reverse KL in ``(1 - r) forward_kl + r reverse_kl``, in [0, 1].
    """

    rkl_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check_fraction("rkl_ratio", self.rkl_ratio, open_interval=False)


TCAD_DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TCADOptions:
    """Options of ``tcad``.

    Attributes:
        divergence: between the renormalised teacher and student on ``U``: ``forward_kl``
            (``KL(p~ || q~)``), ``reverse_kl`` (``KL(q~ || p~)``) or ``jsd``.
        alpha: teacher weight of the ``jsd`` mixture, in (0, 1); only read when ``divergence="jsd"``.
        coverage_coef: weight of the coverage term ``logsumexp_V(z) - logsumexp_U(z)`` (>= 0).
    """

    divergence: str = "forward_kl"
    alpha: float = 0.5
    coverage_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.divergence not in TCAD_DIVERGENCES:
            raise ValueError(
                f"option divergence={self.divergence!r} is not one of {', '.join(TCAD_DIVERGENCES)}"
            )
        _check_fraction("alpha", self.alpha, open_interval=True)
        if self.coverage_coef < 0:
            raise ValueError(f"option coverage_coef={self.coverage_coef} must be >= 0")

    @staticmethod
    def inert_keys(given: dict) -> list[str]:
        """Options that were passed but have no effect with the others given."""
        if "alpha" in given and given.get("divergence", "forward_kl") != "jsd":
            return ["alpha"]
        return []


def _forward_kl_terms(support: SupportInputs) -> SupportTerms:
    valid = support.valid
    teacher_probs = support.teacher_logprobs.exp()  # 0 at padding
    log_q = support.student_logits - support.student_lse.unsqueeze(-1)
    safe_log_p = torch.where(valid, support.teacher_logprobs, torch.zeros_like(teacher_probs))
    loss = torch.where(valid, teacher_probs * (safe_log_p - log_q), torch.zeros_like(teacher_probs)).sum(-1)
    return SupportTerms(loss=loss, grad_support=-teacher_probs, lse_coef=teacher_probs.sum(-1))


def _renormalised(support: SupportInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_p, _ = _masked_log_softmax(support.teacher_logprobs, support.valid)
    log_q, student_lse_on_support = _masked_log_softmax(support.student_logits, support.valid)
    return log_p, log_q, student_lse_on_support


def _support_only(loss: torch.Tensor, grad: torch.Tensor, valid: torch.Tensor) -> SupportTerms:
    grad = torch.where(valid, grad, torch.zeros_like(grad))
    return SupportTerms(loss=loss, grad_support=grad, lse_coef=torch.zeros_like(loss))


@register_divergence("forward_kl", options=NoOptions, cross_tokenizer=True, dense=lambda options: dense.ForwardKL())
def forward_kl(support: SupportInputs, options: NoOptions) -> SupportTerms:
    """``sum_{j in S} P_j (log P_j - log Q_j)``, teacher not renormalised."""
    del options
    return _forward_kl_terms(support)


@register_divergence("reverse_kl", options=NoOptions, cross_tokenizer=True, dense=lambda options: dense.ReverseKL())
def reverse_kl(support: SupportInputs, options: NoOptions) -> SupportTerms:
    """``sum_S Qh (log Qh - log Ph)`` with both distributions renormalised on ``S``."""
    del options
    log_p, log_q, _ = _renormalised(support)
    return _support_only(*_reverse_kl(log_p, log_q, support.valid), support.valid)


@register_divergence("jsd", options=JSDOptions, cross_tokenizer=True, dense=lambda options: dense.JSD(beta=options.beta))
def jsd(support: SupportInputs, options: JSDOptions) -> SupportTerms:
    """Generalised JSD of the renormalised distributions on ``S``."""
    log_p, log_q, _ = _renormalised(support)
    return _support_only(*_jsd(log_p, log_q, support.valid, options.beta), support.valid)


@register_divergence("kl_rkl", options=KLRKLOptions, cross_tokenizer=True,
                     dense=lambda options: dense.KLRKL(ratio=options.rkl_ratio))
def kl_rkl(support: SupportInputs, options: KLRKLOptions) -> SupportTerms:
    """``(1 - r) forward_kl + r reverse_kl``."""
    ratio = options.rkl_ratio
    forward = _forward_kl_terms(support)
    reverse = reverse_kl(support, NoOptions())
    return SupportTerms(
        loss=(1.0 - ratio) * forward.loss + ratio * reverse.loss,
        grad_support=(1.0 - ratio) * forward.grad_support + ratio * reverse.grad_support,
        lse_coef=(1.0 - ratio) * forward.lse_coef,
    )


def _tcad_dense(options: TCADOptions) -> dense.DenseDivergence:
    """Over the whole vocabulary the support is the vocabulary: the renormalised distributions are P and Q
    themselves and the coverage term is identically 0, so TCAD is its ``divergence`` there."""
    return dense.dense_divergence(options.divergence, {"beta": options.alpha} if options.divergence == "jsd" else {})


@register_divergence("tcad", options=TCADOptions, student_support=True, dense=_tcad_dense)
def tcad(support: SupportInputs, options: TCADOptions) -> SupportTerms:
    """Confidence-aligned distillation on the support ``U``: divergence plus coverage term."""
    valid = support.valid
    log_p, log_q, student_lse_on_support = _renormalised(support)
    if options.divergence == "forward_kl":
        loss, grad = _kl(log_p, log_q, valid)
    elif options.divergence == "reverse_kl":
        loss, grad = _reverse_kl(log_p, log_q, valid)
    else:
        loss, grad = _jsd(log_p, log_q, valid, options.alpha)
    # Coverage: d/dz_U of -logsumexp_U(z) is -q~; d/dL is the coefficient itself.
    has_support = valid.any(-1)
    coef = options.coverage_coef * has_support.to(loss.dtype)
    coverage = torch.where(has_support, support.student_lse - student_lse_on_support, torch.zeros_like(loss))
    grad = grad - coef.unsqueeze(-1) * log_q.exp()
    grad = torch.where(valid, grad, torch.zeros_like(grad))
    return SupportTerms(loss=loss + coef * coverage, grad_support=grad, lse_coef=coef)
