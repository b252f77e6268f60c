"""Exact full-vocabulary distillation from the teacher's hidden states, vocab-parallel, fused, chunked.

The teacher sends its final hidden state per token (the input of its output layer); this rank holds
the rows of the teacher's output layer for its own vocabulary shard (the same ids as the student's
shard). For a chunk of tokens the loss computes both models' ``[c, V/tp]`` logits, combines the
log-partitions and top-1 ids over the tensor-parallel group (one all-gather), adds up the divergence's
row sums (one all-reduce), and turns the student's chunk in place into its gradient; the gradients of
the student's hidden states and output weight are accumulated there and the chunk is dropped. Neither
model's logits exist for more than one chunk.

The gradient is computed in the forward, weighted by each token's coefficient: the function returns
the scalar ``sum_i w_i loss_i`` (what the trainer back-propagates), so the backward only scales the
stored gradients by the upstream scalar. That saves recomputing both models' logits (a fused top-k
loss recomputes the student's) at the cost of holding the gradients from forward to backward, which the
backward of any output layer holds anyway. In a forward without autograd (evaluation) no gradient is
computed.

Ids at or past ``real_vocab_size`` (padded embedding rows, on either side) are not tokens: neither
distribution gives them mass and the student's rows there get no gradient.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_gkd.losses.dense import DenseDivergence, dense_divergence
from megatron_gkd.losses.shard_ops import ShardLayout, all_gather_rows, compute_dtype, rows_per_chunk
from megatron_gkd.losses.token_logprobs import vocab_parallel_token_logprobs
from megatron_gkd.losses.vocab_parallel import check_temperature, vocab_parallel_topk

DEFAULT_CHUNK_SIZE = 256
METRIC_KEYS = ("teacher_entropy", "student_entropy", "top1_agreement")


@dataclasses.dataclass(frozen=True, slots=True)
class HiddenOptions:
    """Options of the hidden path.

    Attributes:
        temperature: student distribution ``softmax(logits / temperature)``.
        teacher_temperature: teacher distribution ``softmax(teacher logits / teacher_temperature)``.
        real_vocab_size: ids below it are tokens (``None``: every row of the tables).
        chunk_size: tokens per chunk; memory is about two ``chunk_size x V/tp`` compute-dtype buffers.
        all_reduce_hidden_grad: sum the student hidden gradient over the TP group (as the backward of
            a column-parallel output layer does for a replicated input); off when the caller reduces it
            (sequence parallelism's reduce-scatter).
    """

    temperature: float = 1.0
    teacher_temperature: float = 1.0
    real_vocab_size: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    all_reduce_hidden_grad: bool = True

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_temperature(self.teacher_temperature)
        if self.chunk_size < 1:
            raise ValueError(f"option chunk_size={self.chunk_size} must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class _Shard:
    """This rank's vocabulary shard and the part of it that holds real ids (a prefix)."""

    layout: ShardLayout
    num_real: int  # real ids in this shard: columns [0, num_real)

    @classmethod
    def of(cls, layout: ShardLayout, real_vocab_size: int | None) -> "_Shard":
        layout = dataclasses.replace(layout, real_vocab_size=real_vocab_size)  # checks the size
        return cls(layout, layout.tokens_local)


def _local_max_lse(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: log-sum-exp, maximum and its column, streamed in cache-sized row blocks."""
    rows = rows_per_chunk(logits.shape[1], logits.device)
    lse = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
    best = torch.empty_like(lse)
    where = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        block = logits[start:start + rows]
        best[start:start + rows], where[start:start + rows] = block.max(dim=1)
        lse[start:start + rows] = torch.logsumexp(block, dim=1)
    return lse, best, where


def _combine(student: torch.Tensor, teacher: torch.Tensor, shard: _Shard, dtype: torch.dtype):
    """Global log-partitions of both models and whether their top-1 ids agree, in one all-gather."""
    layout = shard.layout
    num_rows = student.shape[0]
    if shard.num_real:
        lse_s, max_s, arg_s = _local_max_lse(student)
        lse_t, max_t, arg_t = _local_max_lse(teacher)
    else:  # a shard of padding rows only: no mass, never the maximum
        lse_s = max_s = lse_t = max_t = torch.full((num_rows,), float("-inf"), dtype=dtype, device=student.device)
        arg_s = arg_t = torch.zeros(num_rows, dtype=torch.int64, device=student.device)
    offset = layout.vocab_start
    # Ids travel as floats: exact below 2**24 in fp32 (vocabularies are far smaller).
    local = torch.stack([lse_s, lse_t, max_s, (arg_s + offset).to(dtype), max_t, (arg_t + offset).to(dtype)], dim=1)
    gathered = all_gather_rows(local, layout)  # [tp, c, 6]
    lse_s, lse_t = torch.logsumexp(gathered[..., 0], dim=0), torch.logsumexp(gathered[..., 1], dim=0)
    top_s = gathered[..., 3].gather(0, gathered[..., 2].argmax(0, keepdim=True))[0]
    top_t = gathered[..., 5].gather(0, gathered[..., 4].argmax(0, keepdim=True))[0]
    return lse_s, lse_t, (top_s == top_t).to(dtype)


def _all_reduce(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    if layout.tp_size > 1:
        dist.all_reduce(tensor, group=layout.tp_group)
    return tensor


class _Chunk:
    """One chunk's divergence: turns ``log_q`` (this shard's student log-probs) in place into the
    gradient with respect to the student's tempered logits."""

    def __init__(self, divergence: DenseDivergence, shard: _Shard):
        self.divergence, self.shard = divergence, shard

    def run(self, log_q: torch.Tensor, log_p: torch.Tensor, weights: torch.Tensor | None):
        """Returns ``(loss [c], entropies [c, 2])``; with ``weights``, ``log_q`` becomes ``weights x dL/dz``."""
        divergence, num_rows = self.divergence, log_q.shape[0]
        sums = torch.zeros(num_rows, divergence.num_sums + 2, dtype=log_q.dtype, device=log_q.device)
        rows = rows_per_chunk(max(1, log_q.shape[1]), log_q.device)
        for start in range(0, num_rows if self.shard.num_real else 0, rows):
            block_q, block_p = log_q[start:start + rows], log_p[start:start + rows]
            q, p = block_q.exp(), block_p.exp()
            sums[start:start + rows, :-2] = divergence.partial_sums(block_p, block_q, p, q)
            sums[start:start + rows, -2] = -(p * block_p).sum(1)
            sums[start:start + rows, -1] = -(q * block_q).sum(1)
        _all_reduce(sums, self.shard.layout)
        if weights is not None:
            for start in range(0, num_rows if self.shard.num_real else 0, rows):
                block_q, block_p = log_q[start:start + rows], log_p[start:start + rows]
                grad = divergence.grad(block_p, block_q, block_p.exp(), block_q.exp(), sums[start:start + rows])
                block_q.copy_(grad.mul_(weights[start:start + rows, None]))
        return divergence.loss(sums[:, :-2]), sums[:, -2:]


class _HiddenDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, student_weight, teacher_hidden, teacher_weight, weights, divergence, shard, options,
                needs_grad):
        dtype = compute_dtype(student.dtype)
        num_real, num_tokens = shard.num_real, student.shape[0]
        fused = student_weight is not None
        rows = weights.nonzero().squeeze(1)  # only tokens with a coefficient are computed
        loss = torch.zeros(num_tokens, dtype=dtype, device=student.device)
        metrics = torch.zeros(num_tokens, 3, dtype=dtype, device=student.device)
        grad_student = torch.zeros_like(student) if needs_grad else None
        grad_weight = torch.zeros(student_weight.shape, dtype=dtype, device=student.device) \
            if needs_grad and fused else None
        chunk = _Chunk(divergence, shard)
        student_rows = student_weight[:num_real] if fused else None
        teacher_rows = teacher_weight[:num_real]
        for start in range(0, rows.numel(), options.chunk_size):
            index = rows[start:start + options.chunk_size]
            inputs = student.index_select(0, index)
            z_s = (inputs @ student_rows.t() if fused else inputs[:, :num_real]).to(dtype)
            z_t = (teacher_hidden.index_select(0, index) @ teacher_rows.t()).to(dtype)
            if options.temperature != 1.0:
                z_s.div_(options.temperature)
            if options.teacher_temperature != 1.0:
                z_t.div_(options.teacher_temperature)
            lse_s, lse_t, agree = _combine(z_s, z_t, shard, dtype)
            z_s.sub_(lse_s[:, None])  # now log Q
            z_t.sub_(lse_t[:, None])  # now log P
            coefficient = weights.index_select(0, index).to(dtype) / options.temperature if needs_grad else None
            chunk_loss, entropies = chunk.run(z_s, z_t, coefficient)
            loss.index_copy_(0, index, chunk_loss)
            metrics.index_copy_(0, index, torch.cat([entropies, agree[:, None]], dim=1))
            if needs_grad:  # z_s holds d(sum w loss)/d(student logits) of the chunk
                grad_logits = z_s.to(student.dtype)
                if fused:
                    grad_student.index_copy_(0, index, grad_logits @ student_rows)
                    if grad_logits.dtype == dtype:
                        grad_weight[:num_real].addmm_(grad_logits.t(), inputs)
                    else:  # narrow inputs: accumulate in the compute dtype
                        grad_weight[:num_real].add_((grad_logits.t() @ inputs).to(dtype))
                else:
                    grad_student[index, :num_real] = grad_logits
            del z_s, z_t
        if needs_grad and fused and options.all_reduce_hidden_grad:
            _all_reduce(grad_student, shard.layout)
        ctx.grads = (grad_student, None if grad_weight is None else grad_weight.to(student_weight.dtype))
        total = (loss * weights.to(dtype)).sum()
        ctx.mark_non_differentiable(loss, metrics)
        return total, loss, metrics

    @staticmethod
    def backward(ctx, grad_total, *unused):
        del unused
        grad_student, grad_weight = ctx.grads
        ctx.grads = None
        if grad_student is None:
            raise RuntimeError("hidden_distill_loss ran without autograd (no_grad or inputs without requires_grad); "
                               "its gradient was not computed")
        scale = grad_total.to(grad_student.dtype)
        grad_student.mul_(scale)
        if grad_weight is not None:
            grad_weight.mul_(scale.to(grad_weight.dtype))
        return grad_student, grad_weight, None, None, None, None, None, None, None


def hidden_distill_loss(
    student: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    weights: torch.Tensor,
    *,
    loss_type: str,
    tp_group: dist.ProcessGroup | None,
    student_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    real_vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    all_reduce_hidden_grad: bool = True,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted full-vocabulary divergence between the teacher (from its hidden states) and the student.

    Args:
        student: with ``student_weight``, the student's last hidden states ``[N, h_s]`` (or ``[s, b, h_s]``),
            the same on every rank of ``tp_group``; without it, the student's logit shard ``[N, V/tp]``.
        teacher_hidden: ``[N, h_t]`` (or ``[s, b, h_t]``) the teacher's final hidden states (after its last
            norm), the same on every rank; rows of tokens with weight 0 are never read.
        teacher_weight: ``[V/tp, h_t]`` this rank's rows of the teacher's output layer (frozen), the same
            ids as the student's shard (:func:`megatron_gkd.models.teacher_head.load_teacher_head`).
        weights: ``[N]`` (or ``[s, b]``) coefficient of each token in the loss; 0 skips the token.
        loss_type: ``forward_kl``, ``reverse_kl``, ``jsd``, ``kl_rkl`` or ``tcad`` (see :mod:`.dense`).
        tp_group: tensor-parallel group; ``None``: the vocabulary is not split.
        student_weight: ``[V/tp, h_s]`` this rank's rows of the student's output layer (fused), or None.
        temperature, teacher_temperature, real_vocab_size, chunk_size, all_reduce_hidden_grad: see
            :class:`HiddenOptions`.
        **options: the divergence's options (``beta``, ``rkl_ratio``, ``divergence``, ``alpha``).

    Returns:
        ``(total, per_token_loss, metrics)``: the differentiable scalar ``sum_i w_i loss_i`` (fp32, fp64 for
        fp64 inputs), the detached per-token loss and per-token metrics ``teacher_entropy``,
        ``student_entropy`` and ``top1_agreement`` (0 at tokens of weight 0), in ``weights``' shape.

    Raises:
        ValueError: unknown loss or option, bad temperature, or shapes that do not fit together.
    """
    hidden_options = HiddenOptions(temperature=temperature, teacher_temperature=teacher_temperature,
                                   real_vocab_size=real_vocab_size, chunk_size=chunk_size,
                                   all_reduce_hidden_grad=all_reduce_hidden_grad)
    divergence = dense_divergence(loss_type, options)
    lead = weights.shape
    flat_weights = weights.reshape(-1)
    flat_student = student.reshape(-1, student.shape[-1])
    flat_teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    vocab_local = teacher_weight.shape[0]
    if flat_student.shape[0] != flat_weights.numel() or flat_teacher.shape[0] != flat_weights.numel():
        raise ValueError(f"student {tuple(student.shape)}, teacher_hidden {tuple(teacher_hidden.shape)} and weights "
                         f"{tuple(weights.shape)} must hold the same tokens")
    if teacher_weight.dim() != 2 or teacher_weight.shape[1] != flat_teacher.shape[1]:
        raise ValueError(f"teacher_weight {tuple(teacher_weight.shape)} must be [V/tp, h_t] with h_t = "
                         f"teacher_hidden.shape[-1] = {flat_teacher.shape[1]}")
    if student_weight is not None:
        if tuple(student_weight.shape) != (vocab_local, flat_student.shape[1]):
            raise ValueError(f"student_weight {tuple(student_weight.shape)} must be [V/tp={vocab_local}, h_s="
                             f"{flat_student.shape[1]}] (the teacher head shard covers the same ids)")
        if student_weight.dtype != student.dtype:
            raise ValueError(f"student ({student.dtype}) and student_weight ({student_weight.dtype}) must share a dtype")
    elif flat_student.shape[1] != vocab_local:
        raise ValueError(f"student logits [N, {flat_student.shape[1]}] and teacher_weight [{vocab_local}, h_t] must "
                         "cover the same vocabulary shard")
    teacher_hidden_c = flat_teacher.to(teacher_weight.dtype)
    shard = _Shard.of(ShardLayout.of(tp_group, vocab_local), real_vocab_size)
    needs_grad = torch.is_grad_enabled() and (student.requires_grad or
                                              (student_weight is not None and student_weight.requires_grad))
    total, loss, metrics = _HiddenDistill.apply(flat_student, student_weight, teacher_hidden_c, teacher_weight.detach(),
                                                flat_weights, divergence, shard, hidden_options, needs_grad)
    named = {key: metrics[:, i].reshape(lead) for i, key in enumerate(METRIC_KEYS)}
    return total, loss.reshape(lead), named



def hidden_token_logprobs(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    teacher_temperature: float = 1.0,
    real_vocab_size: int | None = None,
) -> torch.Tensor:
    """The log-prob of ``token_ids`` under the teacher distribution that :func:`hidden_distill_loss` builds
    (collective over TP).

    The logits are made as the loss makes them (hidden states cast to the head's dtype, one matmul with this
    rank's rows of real ids), so the result is what the loss trains towards. Each rank's log-partition and the
    logit of the ids it owns are combined over ``tp_group`` in one all-gather of ``[N, 2]``: the vocabulary is
    never gathered. Meant for a sample of tokens: it holds their ``[N, V/tp]`` logits at once.

    Args:
        teacher_hidden: ``[N, h_t]`` the teacher's final hidden states, the same on every rank.
        teacher_weight: ``[V/tp, h_t]`` this rank's rows of the teacher's output layer.
        token_ids: ``[N]`` global ids below ``real_vocab_size``, one per row.
        tp_group: tensor-parallel group; ``None``: the vocabulary is not split.
        teacher_temperature, real_vocab_size: see :class:`HiddenOptions`.

    Returns:
        ``[N]`` log-probs in the compute dtype (fp32, fp64 for a fp64 head), the same on every rank.

    Raises:
        ValueError: shapes that do not fit together, or an id that is not a token.
    """
    check_temperature(teacher_temperature)
    hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    if teacher_weight.dim() != 2 or teacher_weight.shape[1] != hidden.shape[1] or token_ids.numel() != hidden.shape[0]:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)}, teacher_weight {tuple(teacher_weight.shape)} "
                         f"and token_ids {tuple(token_ids.shape)} must be [N, h_t], [V/tp, h_t] and [N]")
    # The loss's logits: a matmul in the head's dtype, widened to the compute dtype; padding rows are left
    # out by real_vocab_size below, as the loss leaves them out.
    logits = (hidden.to(teacher_weight.dtype) @ teacher_weight.t()).to(compute_dtype(teacher_weight.dtype))
    return vocab_parallel_token_logprobs(logits, token_ids, tp_group, temperature=teacher_temperature,
                                         real_vocab_size=real_vocab_size)


def hidden_topk(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None,
    teacher_temperature: float = 1.0,
    real_vocab_size: int | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's exact top-``k`` from its hidden states: ids and log-probs normalised over its whole vocabulary
    (collective over TP; no gradient). A cross-tokenizer teacher's hidden signal is compared this way: its
    vocabulary is not the student's, so its rows are made here and compared through ``W`` like a top-k row.

    The logits are made as :func:`hidden_distill_loss` makes them (the head's dtype, widened), ``chunk_size`` rows
    at a time (one ``[c, V/tp]`` chunk held); each rank's top-``k`` and log-partition are combined over ``tp_group``
    (:func:`~megatron_gkd.losses.vocab_parallel.vocab_parallel_topk`, one all-gather of ``[c]``).

    Args:
        teacher_hidden: ``[N, h_t]`` (or ``[s, b, h_t]``), the same on every rank.
        teacher_weight: ``[V/tp, h_t]`` this rank's rows of the teacher's output layer.
        k: ids per row.
        teacher_temperature, real_vocab_size: see :class:`HiddenOptions` (``real_vocab_size``: the teacher's).

    Returns:
        ``(ids [..., k] int64, logprobs [..., k])`` in the compute dtype, best first, the same on every rank.
    """
    check_temperature(teacher_temperature)
    lead = teacher_hidden.shape[:-1]
    hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    dtype = compute_dtype(teacher_weight.dtype)
    layout = ShardLayout.of(tp_group, teacher_weight.shape[0], real_vocab_size)
    ids = torch.empty(hidden.shape[0], k, dtype=torch.int64, device=hidden.device)
    logprobs = torch.empty(hidden.shape[0], k, dtype=dtype, device=hidden.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_size):
            logits = (hidden[start:start + chunk_size].to(teacher_weight.dtype) @ teacher_weight.t()).to(dtype)
            logits = logits / teacher_temperature
            real = logits[:, : layout.tokens_local]
            local = torch.logsumexp(real, dim=1) if real.shape[1] else torch.full(
                (real.shape[0],), float("-inf"), dtype=dtype, device=real.device)
            lse = torch.logsumexp(all_gather_rows(local, layout), dim=0)
            top_ids, top_logits = vocab_parallel_topk(logits, k, tp_group, real_vocab_size=real_vocab_size)
            ids[start:start + chunk_size] = top_ids
            logprobs[start:start + chunk_size] = top_logits - lse[:, None]
    return ids.reshape(*lead, k), logprobs.reshape(*lead, k)
