"""Vocab-parallel distillation losses on the student's ``[N, V/tp]`` logit shard (no vocabulary gather).

Rank r of ``tp_group`` holds vocabulary ids ``[r V/tp, (r+1) V/tp)``. One forward pass over the shard
computes its local log-partition; one all-gather of ``[N, K+1]`` values combines the log-partitions
and the student logits at the teacher ids; the divergence (see :mod:`.divergences`) then works on
``[N, K]`` tensors. The backward recomputes ``exp`` straight into the gradient buffer, so besides the
gradient itself only a cache-sized scratch chunk is allocated.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_gkd.losses import divergences as _divergences  # noqa: F401 - registers the losses
from megatron_gkd.losses.registry import SupportInputs, get_divergence
from megatron_gkd.losses.shard_ops import (
    LocalSupport,
    ShardLayout,
    SparseGrad,
    all_gather_rows,
    check_token_ids,
    combine_shards,
    compute_dtype,
    local_logsumexp,
    logits_grad,
)
from megatron_gkd.losses.tail import check_tail_bucket, complement_logsumexp, split_partition, tail_terms

logger = logging.getLogger(__name__)

# Teacher log-probs a little above 0 come from rounding (bf16 transport); clearly positive values mean
# the teacher sent logits, not log-probs.
_MAX_TEACHER_LOGPROB = 1e-2


@dataclasses.dataclass(frozen=True, slots=True)
class TeacherSupport:
    """Flattened, validated teacher inputs: ids ``[N, K]``, log-probs ``[N, K]`` in the compute dtype."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor


def prepare_teacher(
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    num_rows: int,
    vocab_size: int,
    dtype: torch.dtype,
) -> TeacherSupport:
    """Flattens the teacher tensors to ``[N, K]`` and rejects malformed input (never a silent zero).

    Raises:
        ValueError: shapes disagree, ids are not integers, a log-prob is NaN / positive, or a valid id
            lies outside ``[0, vocab_size)``.
    """
    if teacher_topk_ids.shape != teacher_topk_logprobs.shape:
        raise ValueError(
            f"teacher_topk_ids {tuple(teacher_topk_ids.shape)} and teacher_topk_logprobs "
            f"{tuple(teacher_topk_logprobs.shape)} must have the same shape"
        )
    if teacher_topk_ids.dtype.is_floating_point or teacher_topk_ids.dtype == torch.bool:
        raise ValueError(f"teacher_topk_ids must be an integer tensor (int64), got {teacher_topk_ids.dtype}")
    num_ids = teacher_topk_ids.shape[-1]
    ids = teacher_topk_ids.reshape(-1, num_ids).long()
    logprobs = teacher_topk_logprobs.reshape(-1, num_ids).to(dtype)
    if ids.shape[0] != num_rows:
        raise ValueError(
            f"teacher tensors hold {ids.shape[0]} tokens but student_logits holds {num_rows}; their "
            "leading dimensions must match ([N, K] with [N, V/tp], or [s, b, K] with [s, b, V/tp])"
        )
    valid = logprobs > float("-inf")
    malformed = torch.stack([
        logprobs.isnan().any(),
        (logprobs > _MAX_TEACHER_LOGPROB).any(),
        (valid & ((ids < 0) | (ids >= vocab_size))).any(),
    ]).tolist()  # one host sync for all three checks
    if malformed[0]:
        raise ValueError("teacher_topk_logprobs contains NaN; mark padding entries with -inf")
    if malformed[1]:
        raise ValueError(
            "teacher_topk_logprobs has positive values: it must hold full-vocabulary log-probabilities, "
            "not logits"
        )
    if malformed[2]:
        raise ValueError(
            f"teacher_topk_ids has a valid entry outside [0, {vocab_size}) (the vocabulary: V/tp x tp, or "
            "real_vocab_size when the table has padding rows); padding entries must carry a -inf log-prob"
        )
    return TeacherSupport(ids, logprobs, valid)


def support_metrics(inputs: SupportInputs) -> dict[str, torch.Tensor]:
    """Teacher and student probability mass on the support, per token."""
    valid = inputs.valid
    teacher_mass = inputs.teacher_logprobs.exp().sum(-1)
    student_on_support = inputs.student_logits.masked_fill(~valid, float("-inf")).logsumexp(-1)
    student_mass = (student_on_support - inputs.student_lse).exp()
    return {"teacher_mass": teacher_mass, "student_mass": student_mass}


def topk_overlap(
    student_logits: torch.Tensor, teacher: TeacherSupport, layout: ShardLayout
) -> torch.Tensor:
    """Fraction of the valid teacher ids that are in the student's top-K (K = teacher width), per token."""
    num_ids = teacher.ids.shape[1]
    student_ids, _ = _topk(student_logits, num_ids, layout)
    sorted_ids, _ = student_ids.sort(dim=1)
    position = torch.searchsorted(sorted_ids, teacher.ids).clamp_(max=num_ids - 1)
    hit = (sorted_ids.gather(1, position) == teacher.ids) & teacher.valid
    count = teacher.valid.sum(1)
    return hit.sum(1).to(teacher.logprobs.dtype) / count.clamp(min=1)


def _topk(logits: torch.Tensor, k: int, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < k <= layout.tokens:
        raise ValueError(f"k={k} must lie in [1, vocabulary size {layout.tokens}]")
    # Padding rows are never candidates: a shard offers its best min(k, V/tp) token columns, -inf after them.
    width, usable = min(k, layout.vocab_size_local), min(k, layout.tokens_local)
    values = logits.new_full((logits.shape[0], width), float("-inf"))
    index = torch.zeros(logits.shape[0], width, dtype=torch.int64, device=logits.device)
    if usable:
        values[:, :usable], index[:, :usable] = logits.detach()[:, : layout.tokens_local].topk(usable, dim=1)
    candidates = all_gather_rows(values, layout)  # [tp, N, k']
    ids = all_gather_rows(index + layout.vocab_start, layout)
    candidates = candidates.permute(1, 0, 2).reshape(logits.shape[0], -1)
    ids = ids.permute(1, 0, 2).reshape(logits.shape[0], -1)
    best, where = candidates.topk(k, dim=1)
    return ids.gather(1, where), best


def vocab_parallel_topk(
    student_logits: torch.Tensor, k: int, tp_group: dist.ProcessGroup | None, real_vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k of the vocab-parallel logits, on every rank.

    Args:
        student_logits: ``[N, V/tp]`` or ``[s, b, V/tp]`` shard of this rank.
        k: number of ids, at most the full vocabulary size.
        tp_group: tensor-parallel group (``None``: the vocabulary is not split).
        real_vocab_size: ids at or past it (padding rows) are never chosen.

    Returns:
        ``(ids, values)``: ``[..., k]`` global int64 ids and their logits (input dtype), best first.
    """
    vocab_local = student_logits.shape[-1]
    layout = ShardLayout.of(tp_group, vocab_local, real_vocab_size)
    ids, values = _topk(student_logits.reshape(-1, vocab_local), k, layout)
    lead = student_logits.shape[:-1]
    return ids.reshape(*lead, k), values.reshape(*lead, k)


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardState:
    """What the backward of either path needs besides the logits (or the tensors that make them).

    The loss itself is not kept here: holding an output on the autograd context would make a
    reference cycle (output -> grad_fn -> ctx -> output) that frees only at garbage collection.

    ``support_lse_coef`` and ``support_probs``: the tail bucket's (:class:`~megatron_gkd.losses.tail.TailTerms`); the
    teacher's ids then get their whole gradient written over the dense part.
    """

    student_lse: torch.Tensor
    grad_support: torch.Tensor
    lse_coef: torch.Tensor
    support: LocalSupport
    vocab_size_local: int
    support_lse_coef: torch.Tensor | None = None
    support_probs: torch.Tensor | None = None


def evaluate_divergence(
    student_lse: torch.Tensor,
    support_logits: torch.Tensor,
    teacher: TeacherSupport,
    support: LocalSupport,
    layout: ShardLayout,
    divergence_name: str,
    options: Any,
    student_tail: torch.Tensor | None = None,
) -> tuple[ForwardState, torch.Tensor, dict[str, torch.Tensor]]:
    """The divergence of the combined ``[N, K]`` support logits, shared by the unfused and fused paths (``support``
    may hold one more column after the teacher's: a sampled token riding along, see :func:`backward_scales`'s
    ``grad_token``). ``student_tail``: ``[N]`` the student's tempered ``logsumexp`` outside the teacher's ids: the
    divergence is then over the ids and the tail bucket (:mod:`.tail`).

    Returns:
        ``(state for the backward, per-token loss, metrics)``.
    """
    inputs = SupportInputs(support_logits, teacher.logprobs, teacher.valid, student_lse)
    divergence = get_divergence(divergence_name)
    if student_tail is None:
        terms = divergence.fn(inputs, options)
        state = ForwardState(student_lse, terms.grad_support, terms.lse_coef, support, layout.vocab_size_local)
    else:
        terms = tail_terms(divergence, inputs, student_tail, options)
        state = ForwardState(student_lse, terms.grad_support, terms.lse_coef, support, layout.vocab_size_local,
                             terms.support_lse_coef, terms.support_probs)
    return state, terms.loss, support_metrics(inputs)


def backward_scales(
    state: ForwardState, grad_loss: torch.Tensor, temperature: float, grad_token: torch.Tensor | None = None
) -> tuple[torch.Tensor, SparseGrad]:
    """Dense per-row scale and sparse support entries of d(loss . grad_loss)/d(logits).

    ``grad_token``: ``[N]`` the gradient of a sampled token's log-prob ``z_y - L`` carried as the support's last
    column (``d/dz_y = 1``, ``d/dL = -1``), added in the same pass.
    """
    grad_loss = grad_loss.to(state.lse_coef.dtype)
    lse_coef = state.lse_coef * grad_loss
    values = state.grad_support * grad_loss.unsqueeze(1)
    if grad_token is not None:
        grad_token = grad_token.to(lse_coef.dtype)
        lse_coef = lse_coef - grad_token
    if state.support_probs is not None:  # the tail bucket: the teacher's ids get their whole gradient written
        width = values.shape[1]
        own = state.support_lse_coef * grad_loss
        if grad_token is not None:
            own = own - grad_token
        values = values + own.unsqueeze(1) * state.support_probs
        token = LocalSupport(state.support.local_index[:, width:], state.support.in_shard[:, width:])
        then = None if grad_token is None else SparseGrad.of(token, grad_token.unsqueeze(1) / temperature,
                                                             state.vocab_size_local)
        return lse_coef / temperature, SparseGrad.of(state.support.columns(width), values / temperature,
                                                     state.vocab_size_local, replace=True, then=then)
    if grad_token is not None:
        values = torch.cat([values, grad_token.unsqueeze(1)], dim=1)
    return lse_coef / temperature, SparseGrad.of(state.support, values / temperature, state.vocab_size_local)


class _VocabParallelDistill(torch.autograd.Function):
    """Per-token distillation loss of a logit shard (and, with ``token_ids``, each row's log-prob of that token from
    the same pass); exact analytic backward, no autograd through comms."""

    @staticmethod
    def forward(ctx, logits, teacher, layout, divergence_name, options, temperature, diagnostics, token_ids,
                tail_bucket):
        dtype = compute_dtype(logits.dtype)
        ids, valid = teacher.ids, teacher.valid
        if token_ids is not None:  # the sampled token: one more support column, gathered with the teacher's
            ids = torch.cat([ids, token_ids.unsqueeze(1)], dim=1)
            valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        support = LocalSupport.of(ids, valid, layout)
        local_support_logits = support.gather(logits, dtype) / temperature
        width = teacher.ids.shape[1]
        tokens = logits[:, : layout.tokens_local]
        if tail_bucket:  # the mass outside the teacher's ids, from which the log-partition follows (.tail)
            local_lse = complement_logsumexp(tokens, support.columns(width), temperature, dtype)
        else:
            local_lse = local_logsumexp(tokens, temperature, dtype)
        student_lse, support_logits = combine_shards(local_lse, local_support_logits, layout)
        student_tail = None
        if tail_bucket:
            student_lse, student_tail = split_partition(student_lse, support_logits[:, :width], teacher.valid)
        state, loss, metrics = evaluate_divergence(
            student_lse, support_logits[:, :width], teacher, support, layout, divergence_name, options, student_tail
        )
        token_logprobs = support_logits[:, width] - student_lse if token_ids is not None else logits.new_empty(0)
        overlap = topk_overlap(logits, teacher, layout) if diagnostics else logits.new_empty(0, dtype=dtype)
        ctx.save_for_backward(logits)
        ctx.state, ctx.temperature, ctx.dtype, ctx.tokens_local = state, temperature, dtype, layout.tokens_local
        ctx.with_tokens = token_ids is not None
        ctx.mark_non_differentiable(metrics["student_mass"], metrics["teacher_mass"], overlap)
        return loss, metrics["student_mass"], metrics["teacher_mass"], overlap, token_logprobs

    @staticmethod
    def backward(ctx, grad_loss, grad_student_mass, grad_teacher_mass, grad_overlap, grad_token):
        del grad_student_mass, grad_teacher_mass, grad_overlap
        (logits,) = ctx.saved_tensors
        dense_scale, sparse = backward_scales(ctx.state, grad_loss, ctx.temperature,
                                              grad_token if ctx.with_tokens else None)
        grad = logits_grad(logits, ctx.state.student_lse, dense_scale, sparse, ctx.temperature, ctx.dtype,
                           ctx.tokens_local)
        return grad, None, None, None, None, None, None, None, None


def split_options(loss_type: str, options: dict[str, Any], common: tuple[str, ...]) -> tuple[Any, dict]:
    """Separates the path's own options (``common``) from the divergence's and validates the latter."""
    own = {key: options[key] for key in common if key in options}
    divergence_options = {key: value for key, value in options.items() if key not in common}
    return get_divergence(loss_type).build_options(divergence_options), own


def check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    return temperature


def vocab_parallel_distill_loss(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    loss_type: str,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token distillation loss computed on this rank's vocabulary shard.

    Args:
        student_logits: ``[N, V/tp]`` or ``[s, b, V/tp]`` logits (fp32, bf16, fp16 or fp64); rank r of
            ``tp_group`` holds ids ``[r V/tp, (r+1) V/tp)``.
        teacher_topk_ids: ``[N, K]`` (or ``[s, b, K]``) int64 global ids, distinct within a row.
        teacher_topk_logprobs: same shape, full-vocabulary-normalised teacher log-probs; ``-inf``
            marks padding entries, which are ignored whatever their id.
        loss_type: a registered divergence: ``forward_kl``, ``reverse_kl``, ``jsd``, ``kl_rkl``,
            ``tcad`` (see :mod:`megatron_gkd.losses.divergences` for the exact definitions).
        tp_group: tensor-parallel group; ``None`` means the vocabulary is not split (TP=1).
        temperature: student probabilities are ``softmax(student_logits / temperature)``.
        **options: the divergence's options (``beta`` for ``jsd``, ``rkl_ratio`` for ``kl_rkl``,
            ``divergence`` / ``alpha`` / ``coverage_coef`` for ``tcad``), ``diagnostics`` (bool,
            default False): also compute the ``topk_overlap`` metric, which costs a vocab-parallel
            top-k and an extra collective, and ``real_vocab_size`` (int, default: every row): ids at or
            past it are padding rows of the table, with no probability and no gradient (the student's
            distribution is the softmax over the tokens), and a teacher id there is refused, and ``token_ids``
            (``[N]`` or ``[s, b]``, default None): one token per row whose log-prob ``log softmax(logits / T)[y]``
            is also returned, from the same pass over the shard (the policy-gradient term's sampled tokens), and
            ``tail_bucket`` (bool, default False): the divergence is over ``K+1`` outcomes, the teacher's ids and the
            mass outside them on both sides (:mod:`megatron_gkd.losses.tail`; not with ``tcad``).

    Returns:
        ``(per_token_loss, metrics)``: the loss ``[N]`` (or ``[s, b]``) in fp32 (fp64 for fp64
        logits), neither masked nor averaged (the trainer weighs each token), and detached per-token
        metrics of the same shape: ``teacher_mass`` and ``student_mass`` (probability on the teacher
        ids), plus ``topk_overlap`` with ``diagnostics=True``. Rows whose teacher entries are all
        padding have loss 0 and gradient 0.

    Raises:
        ValueError: unknown ``loss_type`` or option, bad temperature, malformed teacher tensors, ``tail_bucket`` with
            ``tcad``.
    """
    divergence_options, own = split_options(loss_type, options, ("diagnostics", "real_vocab_size", "token_ids",
                                                                 "tail_bucket"))
    tail_bucket = bool(own.get("tail_bucket", False))
    if tail_bucket:
        check_tail_bucket(get_divergence(loss_type))
    temperature = check_temperature(temperature)
    vocab_local = student_logits.shape[-1]
    lead = student_logits.shape[:-1]
    logits = student_logits.reshape(-1, vocab_local)
    layout = ShardLayout.of(tp_group, vocab_local, own.get("real_vocab_size"))
    teacher = prepare_teacher(
        teacher_topk_ids, teacher_topk_logprobs, logits.shape[0], layout.tokens, compute_dtype(logits.dtype)
    )
    diagnostics = bool(own.get("diagnostics", False))
    token_ids = own.get("token_ids")
    if token_ids is not None:
        token_ids = check_token_ids(token_ids.to(logits.device), logits.shape[0], layout.tokens)
    loss, student_mass, teacher_mass, overlap, token_logprobs = _VocabParallelDistill.apply(
        logits, teacher, layout, loss_type, divergence_options, temperature, diagnostics, token_ids, tail_bucket
    )
    metrics = {"student_mass": student_mass.reshape(lead), "teacher_mass": teacher_mass.reshape(lead)}
    if diagnostics:
        metrics["topk_overlap"] = overlap.reshape(lead)
    if token_ids is not None:
        metrics["token_logprobs"] = token_logprobs.reshape(lead)
    return loss.reshape(lead), metrics
