"""The tail bucket: a top-k divergence as a true divergence between two distributions over k+1 outcomes.

A top-k teacher row says nothing of the mass outside its k ids ``S``: forward KL on it is truncated, and reverse KL
and JSD compare distributions renormalised on ``S``, which lets the student put any mass outside ``S`` unpunished
(where reverse KL collapsed in docs/results.md). With ``tail_bucket=True`` both sides get one more outcome, "any
other token":

* the teacher's is ``1 - sum_S p``, from the log-probs it already sends (normalised over its full vocabulary: the
  teacher response check refuses a row whose top-k sums past 1, :mod:`megatron_gkd.teacher.protocol.types`), floored at
  :data:`TAIL_MASS_FLOOR`;
* the student's is ``1 - sum_S q``, computed as ``logsumexp`` of its logits outside ``S`` on each vocabulary shard
  (padding rows excluded), combined over TP like the log-partition, so it stays exact when ``S`` holds almost all
  the mass, where ``log1p(-sum_S q)`` would keep no digit of it.

Every divergence of :mod:`.divergences` then sees ``k+1`` columns whose two rows each sum to 1 (up to the floor):
``forward_kl`` is the untruncated KL of the two bucketed distributions, ``reverse_kl`` and ``jsd`` renormalise
nothing. The cost is one more number per token in the all-gather.

Gradient: the divergence gives ``g = d loss / d z_tail`` holding the log-partition ``L`` fixed; since
``z_tail = logsumexp_{i not in S} z_i``, an entry outside ``S`` gets ``(lse_coef + c) q_i`` with ``c = g / q_tail``,
which the dense pass over the shard writes on every entry, and an entry of ``S`` its usual
``lse_coef q_i + grad_support_i``, which then *replaces* the dense value there (:class:`.shard_ops.SparseGrad`'s
``replace``). Adding ``- c q_i`` on ``S`` instead would cancel: where ``S`` holds almost all the student's mass,
``c`` is ``~p_tail / q_tail`` (1e10 at a student tail of 1e-11) and float64 kept no better than 1e-6 of the
gradient, float32 nothing. Both vocab-parallel paths keep their one pass over the shard.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_gkd.losses.registry import Divergence, SupportInputs, SupportTerms, teacher_support_divergences
from megatron_gkd.losses.shard_ops import LocalSupport, rows_per_chunk

TAIL_MASS_FLOOR = 1e-6
"""The smallest teacher tail mass. The teacher sends float32 log-probs; summing k of them carries rounding of about
1e-6 (:mod:`megatron_gkd.teacher.protocol.types`), so a tail below it, zero or slightly negative, is rounding: it is read as
the floor, which keeps ``log p_tail`` finite (reverse KL then pushes the student's tail down to about this size)."""

# exp(80) ~ 5.5e34 stays finite in float32. A student tail more than 80 nats below its log-partition is below
# float32's range anyway; its outside gradient is then scaled down rather than overflowing to inf and NaN.
_MAX_TAIL_LOG_RATIO = 80.0


def check_tail_bucket(divergence: Divergence) -> None:
    """Refuses a divergence that has its own account of the student's mass outside its support.

    Raises:
        ValueError: ``divergence`` is TCAD-like (:attr:`Divergence.student_support`).
    """
    if divergence.student_support:
        raise ValueError(
            f"tail_bucket=True does not apply to loss_type={divergence.name!r}: its support is both models' top-k and "
            "its coverage term (coverage_coef) already scores the student's mass outside it; use coverage_coef, or a "
            f"divergence on the teacher's top-k ({', '.join(teacher_support_divergences())}) with the tail bucket"
        )


def complement_logsumexp(
    logits: torch.Tensor, support: LocalSupport, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """``[N]`` ``logsumexp(logits / T)`` over this shard's columns outside the support, in cache-sized row chunks.

    Args:
        logits: ``[N, tokens_local]`` the shard's token columns (padding rows already cut off).
        support: the teacher's ids owned by this shard (each at most once per row).
        temperature, dtype: the student's temperature and the compute dtype.

    Returns:
        ``-inf`` where a row has no column outside the support on this shard.
    """
    num_rows, vocab_local = logits.shape
    if vocab_local == 0:
        return torch.full((num_rows,), float("-inf"), dtype=dtype, device=logits.device)
    # Adding -inf at owned support columns and 0 elsewhere: order-free, so deterministic even where a non-owned
    # entry's placeholder index 0 is also an owned column.
    holes = torch.where(support.in_shard, float("-inf"), 0.0).to(dtype)
    rows = rows_per_chunk(vocab_local, logits.device)
    work = torch.empty(min(rows, num_rows), vocab_local, dtype=dtype, device=logits.device)
    out = torch.empty(num_rows, dtype=dtype, device=logits.device)
    for start in range(0, num_rows, rows):
        stop = min(start + rows, num_rows)
        chunk = work[: stop - start]
        chunk.copy_(logits[start:stop])  # upcast before any arithmetic
        chunk.scatter_add_(1, support.local_index[start:stop], holes[start:stop])
        # The complement's own maximum, not the row's: a tail far below the top-k does not underflow.
        row_max = chunk.amax(dim=1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        chunk.sub_(row_max)
        if temperature != 1.0:
            chunk.div_(temperature)
        chunk.exp_()
        out[start:stop] = row_max.squeeze(1) / temperature + chunk.sum(dim=1).log()
    return out


def split_partition(
    complement_lse: torch.Tensor, support_logits: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's log-partition ``L`` and log tail ``z_tail`` from the global complement ``logsumexp`` and the
    ``[N, K]`` tempered logits at the teacher's ids (``L = logaddexp(z_tail, logsumexp_S z)``, ids distinct)."""
    on_support = support_logits.masked_fill(~valid, float("-inf")).logsumexp(dim=-1)
    return torch.logaddexp(complement_lse, on_support), complement_lse


def teacher_tail_logprob(logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N]`` ``log max(1 - sum_S p, TAIL_MASS_FLOOR)``, summed in float64 (``-expm1``: exact when the sum is
    near 1), returned in the dtype of ``logprobs``."""
    total = logprobs.double().masked_fill(~valid, float("-inf")).logsumexp(dim=-1)
    return (-torch.expm1(total)).clamp_min(TAIL_MASS_FLOOR).log().to(logprobs.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class TailTerms:
    """A divergence over the teacher's ids and the tail, as the backward of either path needs it.

    Attributes:
        loss: ``[N]`` per-token loss.
        grad_support: ``[N, K]`` its derivative with respect to the support logits holding ``L`` and ``z_tail`` fixed.
        lse_coef: ``[N]`` the dense coefficient, exact outside the support: ``support_lse_coef + c``,
            ``c = (d loss / d z_tail) / q_tail`` (no ``c`` where there is no tail).
        support_lse_coef: ``[N]`` the divergence's ``d loss / dL``: an entry of the support gets
            ``support_lse_coef x support_probs + grad_support``, written, not added (kept apart: ``lse_coef - c``
            would lose it to rounding when ``c`` is large).
        support_probs: ``[N, K]`` the student's probabilities at the teacher's ids (0 at padding entries).
    """

    loss: torch.Tensor
    grad_support: torch.Tensor
    lse_coef: torch.Tensor
    support_lse_coef: torch.Tensor
    support_probs: torch.Tensor


def tail_terms(divergence: Divergence, inputs: SupportInputs, student_tail: torch.Tensor, options) -> TailTerms:
    """``divergence`` on the ``k+1`` outcomes (the teacher's ids and the tail) and its gradient in the form the
    backward writes (see the module docstring).

    Args:
        divergence: a registered divergence on the teacher's support.
        inputs: the ``[N, K]`` support inputs (``student_lse`` the full log-partition ``L``).
        student_tail: ``[N]`` tempered ``logsumexp`` of the student's logits outside the teacher's ids (``-inf``
            where the ids cover the whole vocabulary: the tail is then no outcome and is left out).
        options: the divergence's built options.
    """
    valid, lse = inputs.valid, inputs.student_lse
    tail_valid = valid.any(dim=-1) & torch.isfinite(student_tail)
    z_tail = torch.where(tail_valid, student_tail, lse)
    teacher_tail = torch.where(tail_valid, teacher_tail_logprob(inputs.teacher_logprobs, valid),
                               torch.full_like(lse, float("-inf")))
    extended = SupportInputs(
        student_logits=torch.cat([inputs.student_logits, torch.where(tail_valid, z_tail, 0.0).unsqueeze(1)], dim=1),
        teacher_logprobs=torch.cat([inputs.teacher_logprobs, teacher_tail.unsqueeze(1)], dim=1),
        valid=torch.cat([valid, tail_valid.unsqueeze(1)], dim=1),
        student_lse=lse,
    )
    terms: SupportTerms = divergence.fn(extended, options)
    ratio = (lse - z_tail).clamp(max=_MAX_TAIL_LOG_RATIO)
    outside = torch.where(tail_valid, terms.grad_support[:, -1] * ratio.exp(), torch.zeros_like(lse))
    zero = torch.zeros_like(inputs.student_logits)
    support_probs = torch.where(valid, (inputs.student_logits - lse.unsqueeze(1)).exp(), zero)
    return TailTerms(loss=terms.loss, grad_support=torch.where(valid, terms.grad_support[:, :-1], zero),
                     lse_coef=terms.lse_coef + outside, support_lse_coef=terms.lse_coef, support_probs=support_probs)
