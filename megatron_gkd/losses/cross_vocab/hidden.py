"""Cross-tokenizer distillation from the teacher's hidden states: the student projected through ``W`` into the
teacher's vocabulary, compared with the teacher's EXACT full distribution, vocab-parallel on both sides.

Definitions are those of :mod:`.loss` with the teacher's top-k widened to its whole real vocabulary: with
``p_t = softmax(teacher_hidden @ head^T / T_t)`` and ``q(t) = sum_s W[s, t] softmax(z)(s)`` (``z = logits / T``)
the compared support ``C`` is the real teacher ids with ``q(t) > 0``. ``forward_kl`` is ``sum_C p (log p - log q)``
(nothing renormalised), ``reverse_kl`` and ``jsd`` renormalise both on ``C``, ``kl_rkl`` mixes them. A teacher whose
full distribution equals a top-k row gives the loss of :func:`.cross_vocab_distill_loss` on that row with
``K = V_t``. The teacher mass outside ``C`` is reported as ``unmapped_teacher_mass``.

Layout, per chunk of ``c`` tokens with a nonzero coefficient (rank r holds student ids ``[r V_s/tp, ...)`` and
teacher ids ``[r V_t/tp, ...)``):

1. student and teacher logits of the chunk (``[c, V_s/tp]``, ``[c, V_t/tp]``); one all-gather of ``[c, 2]``
   gives both log-partitions;
2. this rank's partial ``q`` over every teacher id from its map entries (``[c, nnz_local]`` gathered
   probabilities, ``index_add`` into ``[V_t, c]``), one all-reduce of ``[c, V_t]``: every rank holds ``q``;
3. the divergence on this rank's teacher shard, with per-row reductions (the masses on ``C`` with the forward
   KL's sum, then the renormalised divergences' sums);
4. the gradient with respect to ``q`` on the shard, one all-gather to ``[c, V_t]``, and back through ``W``:
   ``d/dz_s = p(s) (lse_coef + sum_t W[s, t] g_t / q(t))``.

As in :mod:`.hidden` the gradient is made in the forward, weighted by each token's coefficient, and the backward
scales it by the upstream scalar. ``q`` is summed in probability space (one summing collective): in fp32 a teacher
id whose projected probability underflows (below ~1e-38) counts as unreached, and the backward's ``g_t / q(t)``
(``-p_t / q(t)`` for the forward KL) overflows where ``q(t)`` is that small beside ``p_t``; the top-k form
(:mod:`.loss`), in log space, has neither limit. Memory: a few ``[c, V_t]`` and
``[c, nnz_local]`` buffers per chunk.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from megatron_gkd.losses.cross_vocab.loss import check_projection
from megatron_gkd.losses.cross_vocab.projection_map import ProjectionShard
from megatron_gkd.losses.hidden import DEFAULT_CHUNK_SIZE, HiddenOptions
from megatron_gkd.losses.registry import cross_tokenizer_divergences, get_divergence
from megatron_gkd.losses.shard_ops import ShardLayout, all_gather_rows, compute_dtype

METRIC_KEYS = ("student_mass", "teacher_mass", "unmapped_teacher_mass")


def _all_reduce(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    if layout.tp_size > 1:
        dist.all_reduce(tensor, group=layout.tp_group)
    return tensor


def _combined_lse(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """``[c, k]`` log-sum-exps over the whole vocabulary from each rank's ``[c, k]`` (one all-gather)."""
    return torch.logsumexp(all_gather_rows(local, layout), dim=0)


def _row_lse(values: torch.Tensor) -> torch.Tensor:
    if values.shape[1] == 0:
        return torch.full((values.shape[0],), float("-inf"), dtype=values.dtype, device=values.device)
    return torch.logsumexp(values, dim=1)


@dataclasses.dataclass(frozen=True, slots=True)
class _Entries:
    """This shard's map entries: student column, teacher id and weight of each, in the compute dtype."""

    student: torch.Tensor
    teacher: torch.Tensor
    weight: torch.Tensor

    @classmethod
    def of(cls, projection: ProjectionShard, dtype: torch.dtype) -> "_Entries":
        counts = projection.indptr[1:] - projection.indptr[:-1]
        teacher = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        return cls(projection.student_index, teacher, projection.weight.to(dtype))


def _divergence_terms(log_p, q, compared, loss_type, options, layout):
    """Loss ``[c]``, ``d loss / d y_t`` on the shard ``[c, V_t/tp]`` (``y_t = log q(t)`` up to ``L``), the dense
    coefficient ``[c]`` and the metrics ``[c, 3]``. ``log_p`` (finite: real ids only) and ``q`` (0 off ``compared``)
    are normalised over the whole vocabularies. Only the terms ``loss_type`` needs are computed: every op here runs
    over ``[c, V_t/tp]``."""
    p = log_p.exp()
    p_compared = torch.where(compared, p, torch.zeros_like(p))
    log_q = torch.where(compared, q, torch.ones_like(q)).log_()  # 0 off C, where every term has a zero factor
    forward = loss_type in ("forward_kl", "kl_rkl")
    columns = [p_compared.sum(1), q.sum(1), (p - p_compared).sum(1)]
    if forward:  # needs no normaliser: it rides in the same reduction
        columns.append((p_compared * (log_p - log_q)).sum(1))
    sums = _all_reduce(torch.stack(columns, dim=1), layout)
    mass_p, mass_q = sums[:, 0], sums[:, 1]
    has = (mass_p > 0) & (mass_q > 0)  # rows with nothing to compare: loss 0, gradient 0
    one = torch.ones_like(mass_p)
    log_mass_p, log_mass_q = torch.where(has, mass_p, one).log(), torch.where(has, mass_q, one).log()
    loss = torch.zeros_like(mass_p)
    grad = torch.zeros_like(p)
    coef = torch.zeros_like(mass_p)
    if forward:
        weight = 1.0 - options.rkl_ratio if loss_type == "kl_rkl" else 1.0
        loss, coef = weight * sums[:, 3], weight * mass_p
        grad = grad.sub_(p_compared, alpha=weight)
    if loss_type != "forward_kl":  # on C, both renormalised
        q_hat = q / torch.where(has, mass_q, one)[:, None]
        log_q_hat, log_p_hat = log_q - log_mass_q[:, None], log_p - log_mass_p[:, None]
        if loss_type == "jsd":
            beta = options.beta
            p_hat = p_compared / torch.where(has, mass_p, one)[:, None]
            log_m = torch.logaddexp(log_p_hat + math.log(beta), log_q_hat + math.log1p(-beta))
            h = (1.0 - beta) * (log_q_hat - log_m)
            row = torch.stack([beta * (p_hat * (log_p_hat - log_m)).sum(1) + (q_hat * h).sum(1),
                               (q_hat * h).sum(1)], dim=1)
            row = _all_reduce(row, layout)
            loss, grad = row[:, 0], q_hat * (h - row[:, 1:2])
        else:
            log_ratio = log_q_hat - log_p_hat
            reverse = _all_reduce((q_hat * log_ratio).sum(1, keepdim=True), layout)
            weight = options.rkl_ratio if loss_type == "kl_rkl" else 1.0
            loss = loss + weight * reverse[:, 0]
            grad = grad.add_(q_hat.mul_(log_ratio.sub_(reverse)), alpha=weight)
    zero = torch.zeros_like(loss)
    metrics = torch.stack([torch.where(has, mass_q, zero), torch.where(has, mass_p, zero), sums[:, 2]], dim=1)
    return torch.where(has, loss, zero), grad.mul_(has[:, None]), torch.where(has, coef, zero), metrics


class _HiddenCrossVocabDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher_hidden, teacher_weight, weights, projection, student_layout, teacher_layout,
                loss_type, divergence_options, options, needs_grad):
        dtype = compute_dtype(student.dtype)
        num_tokens = student.shape[0]
        num_student, num_teacher = student_layout.tokens_local, teacher_layout.tokens_local
        teacher_start, teacher_local = teacher_layout.vocab_start, teacher_layout.vocab_size_local
        entries = _Entries.of(projection, dtype)
        rows = weights.nonzero().squeeze(1)  # only tokens with a coefficient are computed
        loss = torch.zeros(num_tokens, dtype=dtype, device=student.device)
        metrics = torch.zeros(num_tokens, len(METRIC_KEYS), dtype=dtype, device=student.device)
        grad_student = torch.zeros_like(student) if needs_grad else None
        head = teacher_weight[:num_teacher]
        for start in range(0, rows.numel(), options.chunk_size):
            index = rows[start:start + options.chunk_size]
            count = index.numel()
            z = student.index_select(0, index)[:, :num_student].to(dtype)  # [c, V_s/tp]
            z_t = (teacher_hidden.index_select(0, index) @ head.t()).to(dtype)  # [c, V_t/tp]
            if options.temperature != 1.0:
                z.div_(options.temperature)
            if options.teacher_temperature != 1.0:
                z_t.div_(options.teacher_temperature)
            lse = _combined_lse(torch.stack([_row_lse(z), _row_lse(z_t)], dim=1), student_layout)
            probs = (z - lse[:, :1]).exp_()  # [c, V_s/tp] this shard's student probabilities
            # This shard's part of q over every teacher id (the teacher vocabulary padded to tp x V_t/tp), summed.
            # Vocabulary-major [V, c]: the map's gathers and adds move whole rows, not strided columns (~3x faster
            # on the host).
            q = torch.zeros(teacher_layout.vocab_size, count, dtype=dtype, device=student.device)
            q.index_add_(0, entries.teacher, probs.t().contiguous()[entries.student].mul_(entries.weight[:, None]))
            _all_reduce(q, student_layout)
            q_shard = q[teacher_start:teacher_start + num_teacher].t()
            compared = q_shard > 0
            chunk_loss, grad_y, coef, chunk_metrics = _divergence_terms(z_t.sub_(lse[:, 1:]), q_shard, compared,
                                                                        loss_type, divergence_options, teacher_layout)
            loss.index_copy_(0, index, chunk_loss)
            metrics.index_copy_(0, index, chunk_metrics)
            if needs_grad:
                # d/dz_s = p(s) (coef + sum_t W[s, t] g_t / q(t)); g / q on every teacher id (one all-gather).
                ratio_shard = torch.zeros(teacher_local, count, dtype=dtype, device=student.device)  # [V_t/tp, c]
                ratio_shard[:num_teacher] = torch.where(compared, grad_y.div_(q_shard), 0.0).t()  # 0/0 off C
                ratio = all_gather_rows(ratio_shard, teacher_layout).reshape(-1, count)  # [V_t, c]
                back = torch.zeros(num_student, count, dtype=dtype, device=student.device)
                back.index_add_(0, entries.student, ratio[entries.teacher].mul_(entries.weight[:, None]))
                scale = weights.index_select(0, index).to(dtype) / options.temperature
                grad_student[index, :num_student] = (probs.mul_(back.t().add_(coef[:, None]))
                                                     .mul_(scale[:, None]).to(student.dtype))
            del z, z_t, probs, q
        ctx.grad_student = grad_student
        total = (loss * weights.to(dtype)).sum()
        ctx.mark_non_differentiable(loss, metrics)
        return total, loss, metrics

    @staticmethod
    def backward(ctx, grad_total, *unused):
        del unused
        grad_student, ctx.grad_student = ctx.grad_student, None
        if grad_student is None:
            raise RuntimeError("hidden_cross_vocab_distill_loss ran without autograd (no_grad or logits without "
                               "requires_grad); its gradient was not computed")
        return (grad_student.mul_(grad_total.to(grad_student.dtype)),) + (None,) * 10


def hidden_cross_vocab_distill_loss(
    student_logits: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    projection: ProjectionShard,
    weights: torch.Tensor,
    *,
    loss_type: str,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    real_vocab_size: int | None = None,
    teacher_real_vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted divergence between a cross-tokenizer teacher's full distribution (from its hidden states) and
    the student projected into the teacher's vocabulary through ``W``.

    Args:
        student_logits: ``[N, V_s/tp]`` (or ``[s, b, V_s/tp]``) this rank's student logit shard.
        teacher_hidden: ``[N, h_t]`` (or ``[s, b, h_t]``) the teacher's final hidden states, the same on every rank.
        teacher_weight: ``[V_t/tp, h_t]`` this rank's rows of the teacher's output layer (teacher ids
            ``[r V_t/tp, (r+1) V_t/tp)``).
        projection: this rank's :class:`~.projection_map.ProjectionShard` of ``W`` (its student rows).
        weights: ``[N]`` (or ``[s, b]``) coefficient of each token; 0 skips the token.
        loss_type: ``forward_kl``, ``reverse_kl``, ``jsd`` or ``kl_rkl`` (module docstring).
        tp_group: tensor-parallel group; ``None``: neither vocabulary is split.
        temperature, teacher_temperature, chunk_size: see :class:`~.hidden.HiddenOptions`.
        real_vocab_size, teacher_real_vocab_size: ids at or past them are padding rows of the student's and the
            teacher's tables (no mass, no gradient).
        **options: the divergence's options (``beta``, ``rkl_ratio``).

    Returns:
        ``(total, per_token_loss, metrics)``: the differentiable scalar ``sum_i w_i loss_i`` (fp32, fp64 for fp64
        logits), the detached per-token loss and the per-token metrics ``student_mass``, ``teacher_mass`` and
        ``unmapped_teacher_mass`` (0 at tokens of weight 0), in ``weights``' shape.

    Raises:
        ValueError: a loss without a cross-tokenizer form, unknown options, bad temperature, shapes that do not fit
            together, or a projection shard that is not this rank's.
    """
    if not get_divergence(loss_type).cross_tokenizer:  # an unknown name fails here, naming the registered ones
        raise ValueError(f"loss_type={loss_type!r} has no cross-tokenizer form (offered: "
                         f"{', '.join(cross_tokenizer_divergences())})")
    divergence_options = get_divergence(loss_type).build_options(dict(options))
    hidden_options = HiddenOptions(temperature=temperature, teacher_temperature=teacher_temperature,
                                   real_vocab_size=real_vocab_size, chunk_size=chunk_size)
    lead = weights.shape
    flat_weights = weights.reshape(-1)
    logits = student_logits.reshape(-1, student_logits.shape[-1])
    hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    if logits.shape[0] != flat_weights.numel() or hidden.shape[0] != flat_weights.numel():
        raise ValueError(f"student_logits {tuple(student_logits.shape)}, teacher_hidden {tuple(teacher_hidden.shape)} "
                         f"and weights {tuple(weights.shape)} must hold the same tokens")
    if teacher_weight.dim() != 2 or teacher_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"teacher_weight {tuple(teacher_weight.shape)} must be [V_t/tp, h_t] with h_t = "
                         f"teacher_hidden.shape[-1] = {hidden.shape[1]}")
    student_layout = ShardLayout.of(tp_group, logits.shape[1], real_vocab_size)
    teacher_layout = ShardLayout.of(tp_group, teacher_weight.shape[0], teacher_real_vocab_size)
    check_projection(projection, student_layout)
    if projection.teacher_vocab_size > teacher_layout.vocab_size:
        raise ValueError(f"the projection maps into {projection.teacher_vocab_size} teacher ids but the teacher's "
                         f"output layer has {teacher_layout.vocab_size} rows (tp x V_t/tp)")
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    total, loss, metrics = _HiddenCrossVocabDistill.apply(
        logits, hidden.to(teacher_weight.dtype), teacher_weight.detach(), flat_weights, projection, student_layout,
        teacher_layout, loss_type, divergence_options, hidden_options, needs_grad)
    named = {key: metrics[:, i].reshape(lead) for i, key in enumerate(METRIC_KEYS)}
    return total, loss.reshape(lead), named
