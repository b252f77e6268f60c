"""Divergences over the whole (real) vocabulary, written for one streamed pass over logit shards.

The hidden-signal path (:mod:`.hidden`) knows both distributions everywhere, so it needs no support,
no renormalisation and no coverage term: ``P`` (teacher) and ``Q`` (student) are the softmaxes over
every real id. Each divergence works on a row block ``[r, V_shard]`` of log-probs in two phases with one
all-reduce between them:

1. :meth:`DenseDivergence.partial_sums` adds this shard's contribution to ``num_sums`` row sums;
2. after the sums are reduced over the tensor-parallel group, :meth:`DenseDivergence.loss` gives the
   per-token loss and :meth:`DenseDivergence.grad` the exact gradient with respect to the student's
   tempered logits ``z`` (``Q = softmax(z)``), elementwise given the reduced sums.

Each divergence registers its form here with ``dense=`` (:mod:`.registry`); definitions (sums over the real
vocabulary):

* ``forward_kl``: ``sum P (log P - log Q)``; gradient ``Q - P``.
* ``reverse_kl``: ``sum Q (log Q - log P)``; gradient ``Q (log Q - log P - KL)``.
* ``jsd``: ``beta KL(P || M) + (1 - beta) KL(Q || M)``, ``M = beta P + (1 - beta) Q``; with
  ``h = (1 - beta)(log Q - log M)`` the gradient is ``Q (h - sum Q h)``.
* ``kl_rkl``: ``(1 - r) forward_kl + r reverse_kl``.
* ``tcad``: its ``divergence`` option over the whole vocabulary. The support is the vocabulary, so the
  renormalised distributions are ``P`` and ``Q`` themselves and the coverage term is identically 0;
  TCAD's confidence weighting (the per-sequence coefficients) applies as on the top-k path.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from megatron_gkd.losses.registry import dense_divergences, get_divergence

logger = logging.getLogger(__name__)


class DenseDivergence:
    """One divergence in the two-phase form (see the module docstring)."""

    num_sums: int = 1

    def partial_sums(self, log_p: torch.Tensor, log_q: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``[r, num_sums]`` this shard's part of the row sums."""
        raise NotImplementedError

    def loss(self, sums: torch.Tensor) -> torch.Tensor:
        """``[r]`` per-token loss from the reduced sums."""
        return sums[:, 0]

    def grad(self, log_p, log_q, p, q, sums: torch.Tensor) -> torch.Tensor:
        """``[r, V_shard]`` d loss / d z on this shard."""
        raise NotImplementedError


class ForwardKL(DenseDivergence):
    def partial_sums(self, log_p, log_q, p, q):
        return (p * (log_p - log_q)).sum(1, keepdim=True)

    def grad(self, log_p, log_q, p, q, sums):
        return q - p


class ReverseKL(DenseDivergence):
    def partial_sums(self, log_p, log_q, p, q):
        return (q * (log_q - log_p)).sum(1, keepdim=True)

    def grad(self, log_p, log_q, p, q, sums):
        return q * (log_q - log_p - sums[:, :1])


@dataclasses.dataclass(frozen=True)
class JSD(DenseDivergence):
    beta: float
    num_sums: int = 2  # the loss, and S = sum Q h

    def _log_m(self, log_p, log_q):
        return torch.logaddexp(log_p + math.log(self.beta), log_q + math.log1p(-self.beta))

    def partial_sums(self, log_p, log_q, p, q):
        log_m = self._log_m(log_p, log_q)
        q_term = q * (log_q - log_m)
        loss = self.beta * (p * (log_p - log_m)).sum(1) + (1.0 - self.beta) * q_term.sum(1)
        return torch.stack([loss, (1.0 - self.beta) * q_term.sum(1)], dim=1)

    def grad(self, log_p, log_q, p, q, sums):
        h = (1.0 - self.beta) * (log_q - self._log_m(log_p, log_q))
        return q * (h - sums[:, 1:2])


@dataclasses.dataclass(frozen=True)
class KLRKL(DenseDivergence):
    ratio: float
    num_sums: int = 2  # forward KL, reverse KL

    def partial_sums(self, log_p, log_q, p, q):
        return torch.cat([ForwardKL().partial_sums(log_p, log_q, p, q),
                          ReverseKL().partial_sums(log_p, log_q, p, q)], dim=1)

    def loss(self, sums):
        return (1.0 - self.ratio) * sums[:, 0] + self.ratio * sums[:, 1]

    def grad(self, log_p, log_q, p, q, sums):
        reverse = ReverseKL().grad(log_p, log_q, p, q, sums[:, 1:2])
        return (1.0 - self.ratio) * (q - p) + self.ratio * reverse


_warned: set[str] = set()


def dense_divergence(loss_type: str, options: dict) -> DenseDivergence:
    """The full-vocabulary form of the registered divergence ``loss_type`` with its options (its registered
    ``dense``).

    Options are validated by the registered divergence's own options class, so a name or option the
    top-k path refuses is refused here with the same message.

    Raises:
        ValueError: unknown ``loss_type`` or option, or a divergence without a full-vocabulary form.
    """
    divergence = get_divergence(loss_type)
    built = divergence.build_options(dict(options))
    if divergence.dense is None:
        raise ValueError(f"loss_type={loss_type!r} has no full-vocabulary form for teacher.signal=hidden; use "
                         f"{', '.join(dense_divergences())}")
    if divergence.student_support and "coverage_coef" in options and loss_type not in _warned:
        _warned.add(loss_type)
        logger.warning("loss.options.coverage_coef has no effect with teacher.signal=hidden: the support is the "
                       "whole vocabulary, so no student mass leaks outside it")
    return divergence.dense(built)
