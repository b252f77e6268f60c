"""Fused output layer + cross-tokenizer loss (:mod:`.loss`), chunked over tokens: the student's
``[N, V_s/tp]`` logits never exist, as in :mod:`.fused`, whose structure this module follows function for function.

:func:`fused_projection_partials` (``fused_partials``) computes each token chunk's logits ``hidden_c @ W^T``, keeps its
local log-partition and the projected logits at the teacher ids (the heavy ids' dense product and the map entries of
one block of rows at a time, blocks cut at chunk edges), and drops the chunk; one all-gather then combines every
rank's partial values. :func:`fused_projection_grads` (``fused_grads``) takes the backward's scales once, recomputes
each chunk's logits and turns them in place into the logit gradient in row pieces, adding the support part to each
piece as ``fused_grads`` adds its sparse one. The one difference: the support part's values depend on the logits, so
a piece never crosses a block's edge, and each block's values are read (:meth:`~.cross_vocab.ProjectionGrad.ensure`)
before its first rows are overwritten.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_gkd.losses.cross_vocab.loss import (
    LocalPlan,
    ProjectedState,
    check_projection,
    combine_projection,
    evaluate_projection,
    local_pass,
    projection_grad,
)
from megatron_gkd.losses.cross_vocab.projection_map import ProjectionShard
from megatron_gkd.losses.fused import FusedOptions, check_hidden_and_weight
from megatron_gkd.losses.registry import cross_tokenizer_divergences, get_divergence
from megatron_gkd.losses.shard_ops import (
    ShardLayout,
    WeightGrad,
    compute_dtype,
    rows_per_chunk,
    write_grad_rows,
    zero_padding_columns,
)
from megatron_gkd.losses.vocab_parallel import TeacherSupport, check_temperature, prepare_teacher, split_options


def _split_at_chunks(blocks: list[tuple[int, int]], chunk_size: int) -> list[tuple[int, int]]:
    """The blocks cut at every token-chunk edge, so that each lies inside one chunk's logits."""
    out = []
    for start, stop in blocks:
        while start < stop:
            edge = min(stop, (start // chunk_size + 1) * chunk_size)
            out.append((start, edge))
            start = edge
    return out


def _pieces(blocks: list[tuple[int, int]], start: int, stop: int, rows: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` in pieces of at most ``rows``, cut at the blocks' edges."""
    out = []
    for block_start, block_stop in blocks:
        for row in range(max(start, block_start), min(stop, block_stop), rows):
            out.append((row, min(row + rows, block_stop, stop)))
    return out


def fused_projection_partials(
    hidden: torch.Tensor, weight: torch.Tensor, teacher: TeacherSupport, projection: ProjectionShard, plan: LocalPlan,
    layout: ShardLayout, chunk_size: int, temperature: float, dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's ``[N, K]`` projected logits of ``hidden @ weight^T``, filling ``plan.local_lse`` (and
    ``plan.dense``), one token chunk of logits at a time."""
    num_tokens = hidden.shape[0]
    local_projected = torch.empty(teacher.ids.shape, dtype=dtype, device=hidden.device)
    for start in range(0, num_tokens, chunk_size):
        stop = min(start + chunk_size, num_tokens)
        logits = hidden[start:stop] @ weight.t()  # [c, V/tp]
        local_pass(logits, teacher, projection, plan, [b for b in plan.blocks if start <= b[0] < stop], temperature,
                   dtype, layout.tokens_local, out=local_projected, row_offset=start)
        del logits
    return local_projected


def fused_projection_grads(
    hidden: torch.Tensor, weight: torch.Tensor, state: ProjectedState, grad_loss: torch.Tensor,
    projection: ProjectionShard, layout: ShardLayout, fused: FusedOptions, temperature: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``sum(grad_loss x loss)`` with respect to ``hidden`` and ``weight``, recomputing each chunk's
    logits (:func:`megatron_gkd.losses.fused.fused_grads` with the projection's support part)."""
    dense_scale, sparse = projection_grad(state, grad_loss, projection, temperature, dtype)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = WeightGrad(weight, dtype)
    rows = rows_per_chunk(weight.shape[0], weight.device)
    shift = (state.student_lse * temperature).unsqueeze(1)
    dense_scale = dense_scale.unsqueeze(1)
    for start in range(0, hidden.shape[0], fused.chunk_size):
        stop = min(start + fused.chunk_size, hidden.shape[0])
        logits = hidden[start:stop] @ weight.t()
        sparse.attach(logits, start)
        # fp32/fp64 logits become their own gradient; narrow ones need a compute-dtype copy.
        grad_logits = logits if logits.dtype == dtype else torch.empty_like(logits, dtype=dtype)
        for row, row_stop in _pieces(state.plan.blocks, start, stop, rows):
            sparse.ensure(row)  # read the block's logits before its rows become gradient
            out = grad_logits[row - start:row_stop - start]
            write_grad_rows(logits[row - start:row_stop - start], shift[row:row_stop], dense_scale[row:row_stop],
                            temperature, out)
            zero_padding_columns(out, layout.tokens_local)
            sparse.add_to_rows(out, row, row_stop)
        grad_logits = grad_logits.to(hidden.dtype)
        torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        grad_weight.add(grad_logits, hidden[start:stop])
        del logits, grad_logits
    if fused.all_reduce_hidden_grad and layout.tp_size > 1:
        dist.all_reduce(grad_hidden, group=layout.tp_group)
    return grad_hidden, grad_weight.result()


class _FusedCrossVocabDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher, projection, layout, divergence_name, options, fused, temperature):
        dtype = compute_dtype(hidden.dtype)
        plan = LocalPlan.of(teacher, projection, dtype)
        plan = dataclasses.replace(plan, blocks=_split_at_chunks(plan.blocks, fused.chunk_size))
        local_projected = fused_projection_partials(hidden, weight, teacher, projection, plan, layout,
                                                    fused.chunk_size, temperature, dtype)
        student_lse, projected = combine_projection(plan.local_lse, local_projected, layout)
        state, loss, metrics = evaluate_projection(student_lse, projected, teacher, plan, divergence_name, options)
        ctx.save_for_backward(hidden, weight)
        ctx.state, ctx.projection, ctx.layout, ctx.fused = state, projection, layout, fused
        ctx.temperature, ctx.dtype = temperature, dtype
        ctx.mark_non_differentiable(*metrics.values())
        return loss, metrics["student_mass"], metrics["teacher_mass"], metrics["unmapped_teacher_mass"]

    @staticmethod
    def backward(ctx, grad_loss, grad_student_mass, grad_teacher_mass, grad_unmapped):
        del grad_student_mass, grad_teacher_mass, grad_unmapped
        hidden, weight = ctx.saved_tensors
        grad_hidden, grad_weight = fused_projection_grads(hidden, weight, ctx.state, grad_loss, ctx.projection,
                                                          ctx.layout, ctx.fused, ctx.temperature, ctx.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def fused_cross_vocab_distill_loss(
    hidden: torch.Tensor,
    output_weight_shard: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    projection: ProjectionShard,
    *,
    loss_type: str,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~megatron_gkd.losses.cross_vocab.loss.cross_vocab_distill_loss` of ``hidden @ output_weight_shard^T``,
    chunked over tokens.

    Args:
        hidden: ``[N, h]`` or ``[s, b, h]`` last hidden states, the same on every rank of ``tp_group``.
        output_weight_shard: ``[V_s/tp, h]`` this rank's rows of the student's output-layer weight.
        teacher_topk_ids, teacher_topk_logprobs, projection, loss_type, tp_group, temperature, real_vocab_size: as
            for :func:`~megatron_gkd.losses.cross_vocab.loss.cross_vocab_distill_loss`.
        **options: the divergence's options, plus ``chunk_size`` and ``all_reduce_hidden_grad`` of
            :class:`~megatron_gkd.losses.fused.FusedOptions`.

    Returns:
        ``(per_token_loss, metrics)`` as the unfused loss; the gradient flows to ``hidden`` and the weight shard.
    """
    if not get_divergence(loss_type).cross_tokenizer:  # an unknown name fails here, naming the registered ones
        raise ValueError(f"loss_type={loss_type!r} has no cross-tokenizer form (offered: "
                         f"{', '.join(cross_tokenizer_divergences())})")
    divergence_options, own = split_options(loss_type, options, ("chunk_size", "all_reduce_hidden_grad"))
    fused = FusedOptions(**own)
    temperature = check_temperature(temperature)
    check_hidden_and_weight(hidden, output_weight_shard)
    lead = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    layout = ShardLayout.of(tp_group, output_weight_shard.shape[0], real_vocab_size)
    check_projection(projection, layout)
    teacher = prepare_teacher(teacher_topk_ids, teacher_topk_logprobs, flat_hidden.shape[0],
                              projection.teacher_vocab_size, compute_dtype(hidden.dtype))
    loss, student_mass, teacher_mass, unmapped = _FusedCrossVocabDistill.apply(
        flat_hidden, output_weight_shard, teacher, projection, layout, loss_type, divergence_options, fused, temperature
    )
    metrics = {"student_mass": student_mass, "teacher_mass": teacher_mass, "unmapped_teacher_mass": unmapped}
    return loss.reshape(lead), {name: value.reshape(lead) for name, value in metrics.items()}
