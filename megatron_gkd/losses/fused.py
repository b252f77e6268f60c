"""Fused output layer + distillation loss, chunked over tokens: the ``[N, V/tp]`` logits never exist.

The forward computes each token chunk's logits ``hidden_c @ W^T``, keeps only its local log-partition
and the logits at the teacher ids, and drops the chunk; the backward recomputes the chunk's logits,
turns them in place into the logit gradient, and accumulates the gradients of ``hidden`` and ``W``.
Peak extra memory is one chunk of logits (plus its compute-dtype copy for narrow inputs) and the hidden gradient;
the weight's gradient is added into the fp32 buffer of Megatron's DDP where it has one (``main_grad``), else into one
fp32 accumulator the backward returns (:class:`~megatron_gkd.losses.shard_ops.WeightGrad`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_gkd.losses.registry import get_divergence
from megatron_gkd.losses.shard_ops import (
    LocalSupport,
    ShardLayout,
    WeightGrad,
    check_token_ids,
    combine_shards,
    compute_dtype,
    local_logsumexp,
    rows_per_chunk,
    write_grad_rows,
    zero_padding_columns,
)
from megatron_gkd.losses.tail import check_tail_bucket, complement_logsumexp, split_partition
from megatron_gkd.losses.vocab_parallel import (
    ForwardState,
    backward_scales,
    check_temperature,
    evaluate_divergence,
    prepare_teacher,
    split_options,
)

DEFAULT_CHUNK_SIZE = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class FusedOptions:
    """Options of the fused path (on top of the divergence's).

    Attributes:
        chunk_size: tokens per chunk; memory is about ``chunk_size x V/tp`` logits.
        all_reduce_hidden_grad: sum the hidden gradient over ``tp_group`` in the backward, as the
            backward of Megatron's column-parallel output layer does for a replicated input. Turn it
            off when the caller reduces it itself (e.g. sequence parallelism's reduce-scatter).
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    all_reduce_hidden_grad: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"option chunk_size={self.chunk_size} must be >= 1")


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[c, V/tp]`` logits in the input dtype, as the unfused output layer would produce them."""
    return hidden @ weight.t()


def fused_partials(
    hidden: torch.Tensor, weight: torch.Tensor, support: LocalSupport, layout: ShardLayout, chunk_size: int,
    temperature: float, dtype: torch.dtype, complement: LocalSupport | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[N]`` log-partition and ``[N, K]`` tempered logits at the owned ids of
    ``hidden @ weight^T``, one token chunk of logits at a time (shared by every fused term). With ``complement``
    (the teacher's ids), the ``logsumexp`` is over the columns outside them instead (the tail bucket, :mod:`.tail`)."""
    num_tokens = hidden.shape[0]
    local_lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
    local_support_logits = torch.empty(support.local_index.shape, dtype=dtype, device=hidden.device)
    for start in range(0, num_tokens, chunk_size):
        stop = min(start + chunk_size, num_tokens)
        logits = _chunk_logits(hidden[start:stop], weight)  # [c, V/tp]
        tokens = logits[:, : layout.tokens_local]
        if complement is None:
            local_lse[start:stop] = local_logsumexp(tokens, temperature, dtype)
        else:
            chunk_complement = LocalSupport(complement.local_index[start:stop], complement.in_shard[start:stop])
            local_lse[start:stop] = complement_logsumexp(tokens, chunk_complement, temperature, dtype)
        chunk_support = LocalSupport(support.local_index[start:stop], support.in_shard[start:stop])
        local_support_logits[start:stop] = chunk_support.gather(logits, dtype) / temperature
        del logits
    return local_lse, local_support_logits


def fused_grads(
    hidden: torch.Tensor, weight: torch.Tensor, state: ForwardState, grad_loss: torch.Tensor, layout: ShardLayout,
    fused: FusedOptions, temperature: float, dtype: torch.dtype, grad_token: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``sum(grad_loss x loss)`` with respect to ``hidden`` and ``weight`` for a term whose logit
    gradient is ``lse_coef x softmax + grad_support`` (the form of :class:`~megatron_gkd.losses.registry.SupportTerms`),
    recomputing each chunk's logits (``grad_token``: a sampled token's log-prob in the support's last column, see
    :func:`~megatron_gkd.losses.vocab_parallel.backward_scales`). The weight's gradient is None where it went into
    DDP's ``main_grad`` (:class:`~megatron_gkd.losses.shard_ops.WeightGrad`)."""
    dense_scale, sparse = backward_scales(state, grad_loss, temperature, grad_token)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = WeightGrad(weight, dtype)
    rows = rows_per_chunk(weight.shape[0], weight.device)
    shift = (state.student_lse * temperature).unsqueeze(1)
    dense_scale = dense_scale.unsqueeze(1)
    for start in range(0, hidden.shape[0], fused.chunk_size):
        stop = min(start + fused.chunk_size, hidden.shape[0])
        logits = _chunk_logits(hidden[start:stop], weight)
        # fp32/fp64 logits become their own gradient; narrow ones need a compute-dtype copy.
        grad_logits = logits if logits.dtype == dtype else torch.empty_like(logits, dtype=dtype)
        for row in range(0, stop - start, rows):
            row_stop = min(row + rows, stop - start)
            out = grad_logits[row:row_stop]
            write_grad_rows(
                logits[row:row_stop], shift[start + row:start + row_stop],
                dense_scale[start + row:start + row_stop], temperature, out,
            )
            zero_padding_columns(out, layout.tokens_local)
            sparse.add_to_rows(out, start + row, start + row_stop)
        grad_logits = grad_logits.to(hidden.dtype)
        torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        grad_weight.add(grad_logits, hidden[start:stop])
        del logits, grad_logits
    if fused.all_reduce_hidden_grad and layout.tp_size > 1:
        dist.all_reduce(grad_hidden, group=layout.tp_group)
    return grad_hidden, grad_weight.result()


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher, layout, divergence_name, options, fused, temperature, token_ids,
                tail_bucket):
        dtype = compute_dtype(hidden.dtype)
        ids, valid = teacher.ids, teacher.valid
        if token_ids is not None:  # the sampled token: one more support column (see _VocabParallelDistill)
            ids = torch.cat([ids, token_ids.unsqueeze(1)], dim=1)
            valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        support = LocalSupport.of(ids, valid, layout)
        width = teacher.ids.shape[1]
        complement = support.columns(width) if tail_bucket else None
        local_lse, local_support_logits = fused_partials(hidden, weight, support, layout, fused.chunk_size,
                                                         temperature, dtype, complement)
        student_lse, support_logits = combine_shards(local_lse, local_support_logits, layout)
        student_tail = None
        if tail_bucket:
            student_lse, student_tail = split_partition(student_lse, support_logits[:, :width], teacher.valid)
        state, loss, metrics = evaluate_divergence(
            student_lse, support_logits[:, :width], teacher, support, layout, divergence_name, options, student_tail
        )
        token_logprobs = support_logits[:, width] - student_lse if token_ids is not None else hidden.new_empty(0)
        ctx.save_for_backward(hidden, weight)
        ctx.state, ctx.layout, ctx.fused, ctx.temperature, ctx.dtype = state, layout, fused, temperature, dtype
        ctx.with_tokens = token_ids is not None
        ctx.mark_non_differentiable(metrics["student_mass"], metrics["teacher_mass"])
        return loss, metrics["student_mass"], metrics["teacher_mass"], token_logprobs

    @staticmethod
    def backward(ctx, grad_loss, grad_student_mass, grad_teacher_mass, grad_token):
        del grad_student_mass, grad_teacher_mass
        hidden, weight = ctx.saved_tensors
        grad_hidden, grad_weight = fused_grads(hidden, weight, ctx.state, grad_loss, ctx.layout, ctx.fused,
                                               ctx.temperature, ctx.dtype, grad_token if ctx.with_tokens else None)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def check_hidden_and_weight(hidden: torch.Tensor, output_weight_shard: torch.Tensor) -> None:
    """A fused path's inputs fit together: ``[..., h]`` hidden states and a ``[V/tp, h]`` weight of one dtype.

    Raises:
        ValueError: they do not.
    """
    if output_weight_shard.dim() != 2 or hidden.shape[-1] != output_weight_shard.shape[1]:
        raise ValueError(f"output_weight_shard {tuple(output_weight_shard.shape)} must be [V/tp, h] with h = "
                         f"hidden.shape[-1] = {hidden.shape[-1]}")
    if hidden.dtype != output_weight_shard.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and output_weight_shard ({output_weight_shard.dtype}) "
                         "must share a dtype")


def fused_vocab_parallel_distill_loss(
    hidden: torch.Tensor,
    output_weight_shard: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    loss_type: str,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`vocab_parallel_distill_loss` of ``hidden @ output_weight_shard^T``, chunked over tokens.

    Args:
        hidden: ``[N, h]`` or ``[s, b, h]`` last hidden states, the same on every rank of ``tp_group``
            (the input of Megatron's column-parallel output layer without sequence parallelism).
        output_weight_shard: ``[V/tp, h]`` this rank's rows of the output-layer weight.
        teacher_topk_ids, teacher_topk_logprobs, loss_type, tp_group, temperature: as for
            :func:`vocab_parallel_distill_loss`.
        **options: the divergence's options, ``real_vocab_size`` and ``token_ids`` as for
            :func:`vocab_parallel_distill_loss` (padding rows of the weight get a zero gradient), plus ``chunk_size``
            (tokens per chunk, default 1024) and ``all_reduce_hidden_grad`` (default True) of :class:`FusedOptions`,
            and ``tail_bucket`` as for :func:`vocab_parallel_distill_loss`.

    Returns:
        ``(per_token_loss, metrics)`` as :func:`vocab_parallel_distill_loss` (``teacher_mass``,
        ``student_mass``); the gradient flows to both ``hidden`` and ``output_weight_shard``.

    Raises:
        ValueError: as :func:`vocab_parallel_distill_loss`, or shapes of hidden and weight disagree.
    """
    if options.pop("diagnostics", False):
        raise ValueError(
            "diagnostics=True is not available on the fused path (the logits never exist in full); "
            "compute the overlap from vocab_parallel_topk on a logits chunk if needed"
        )
    divergence_options, own = split_options(loss_type, options, ("chunk_size", "all_reduce_hidden_grad",
                                                                 "real_vocab_size", "token_ids", "tail_bucket"))
    real_vocab_size = own.pop("real_vocab_size", None)
    token_ids = own.pop("token_ids", None)
    tail_bucket = bool(own.pop("tail_bucket", False))
    if tail_bucket:
        check_tail_bucket(get_divergence(loss_type))
    fused = FusedOptions(**own)
    temperature = check_temperature(temperature)
    check_hidden_and_weight(hidden, output_weight_shard)
    lead = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    layout = ShardLayout.of(tp_group, output_weight_shard.shape[0], real_vocab_size)
    teacher = prepare_teacher(
        teacher_topk_ids, teacher_topk_logprobs, flat_hidden.shape[0], layout.tokens,
        compute_dtype(hidden.dtype),
    )
    if token_ids is not None:
        token_ids = check_token_ids(token_ids.to(hidden.device), flat_hidden.shape[0], layout.tokens)
    loss, student_mass, teacher_mass, token_logprobs = _FusedDistill.apply(
        flat_hidden, output_weight_shard, teacher, layout, loss_type, divergence_options, fused, temperature, token_ids,
        tail_bucket,
    )
    metrics = {"student_mass": student_mass.reshape(lead), "teacher_mass": teacher_mass.reshape(lead)}
    if token_ids is not None:
        metrics["token_logprobs"] = token_logprobs.reshape(lead)
    return loss.reshape(lead), metrics
