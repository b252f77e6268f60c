"""The log-probability of one given token per row, vocab-parallel, unfused and fused, with its exact gradient.

The policy-gradient term needs ``log pi(y_t) = z_y - logsumexp(z)`` (``z = logits / T``) of the sampled token
``y_t`` from the student's ``[N, V/tp]`` logit shard. Each rank computes its shard's log-partition and the logit of
``y_t`` if it owns that id (an exact 0 otherwise); one all-gather of ``[N, 2]`` combines them
(:func:`~megatron_gkd.losses.shard_ops.combine_shards`), so the vocabulary is never gathered. This is the
distillation losses' support path with a support of one id: the gradient with respect to the full logit row,
``(onehot(y) - softmax(z)) / T``, has the form ``lse_coef x softmax + grad_support`` with ``lse_coef = -1`` and
``grad_support = 1`` at ``y``, so the backward is the same one-pass ``exp`` recomputation into the gradient buffer
(unfused) or the same chunked recomputation of ``hidden @ W^T`` (fused) as the divergences'.

Ids at or past ``real_vocab_size`` (padding rows of the output layer) are not tokens: they carry no probability,
get no gradient, and a sampled id there is refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gkd.losses.fused import FusedOptions, check_hidden_and_weight, fused_grads, fused_partials
from megatron_gkd.losses.shard_ops import (
    LocalSupport,
    ShardLayout,
    check_token_ids,
    combine_shards,
    compute_dtype,
    local_logsumexp,
    logits_grad,
)
from megatron_gkd.losses.vocab_parallel import ForwardState, backward_scales, check_temperature


def _support(token_ids: torch.Tensor, layout: ShardLayout) -> LocalSupport:
    """The sampled ids as a one-entry support ``[N, 1]``; every row has its token."""
    ids = token_ids[:, None]
    return LocalSupport.of(ids, torch.ones_like(ids, dtype=torch.bool), layout)


def _finish(
    local_lse: torch.Tensor, local_token_logits: torch.Tensor, support: LocalSupport, layout: ShardLayout
) -> tuple[ForwardState, torch.Tensor]:
    """Combines the shards' partial values (one all-gather) into ``[N]`` log-probs and the backward's state."""
    lse, token_logits = combine_shards(local_lse, local_token_logits, layout)
    # d logp / d z_y = 1 (the support part), d logp / d lse = -1 (the dense softmax part).
    state = ForwardState(lse, torch.ones_like(token_logits), -torch.ones_like(lse), support, layout.vocab_size_local)
    return state, token_logits[:, 0] - lse


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, token_ids, layout, temperature):
        dtype = compute_dtype(logits.dtype)
        support = _support(token_ids, layout)
        local_token_logits = support.gather(logits, dtype) / temperature  # [N, 1], 0 where another rank owns y
        local_lse = local_logsumexp(logits[:, : layout.tokens_local], temperature, dtype)  # [N]
        state, logprobs = _finish(local_lse, local_token_logits, support, layout)
        ctx.save_for_backward(logits)
        ctx.state, ctx.temperature, ctx.dtype, ctx.tokens_local = state, temperature, dtype, layout.tokens_local
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        (logits,) = ctx.saved_tensors
        dense_scale, sparse = backward_scales(ctx.state, grad_logprobs, ctx.temperature)
        grad = logits_grad(logits, ctx.state.student_lse, dense_scale, sparse, ctx.temperature, ctx.dtype,
                           ctx.tokens_local)
        return grad, None, None, None


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, token_ids, layout, fused, temperature):
        dtype = compute_dtype(hidden.dtype)
        support = _support(token_ids, layout)
        local_lse, local_token_logits = fused_partials(hidden, weight, support, layout, fused.chunk_size,
                                                       temperature, dtype)
        state, logprobs = _finish(local_lse, local_token_logits, support, layout)
        ctx.save_for_backward(hidden, weight)
        ctx.state, ctx.layout, ctx.fused, ctx.temperature, ctx.dtype = state, layout, fused, temperature, dtype
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        hidden, weight = ctx.saved_tensors
        grad_hidden, grad_weight = fused_grads(hidden, weight, ctx.state, grad_logprobs, ctx.layout, ctx.fused,
                                               ctx.temperature, ctx.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    token_ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    *,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
) -> torch.Tensor:
    """``log softmax(logits / T)[y]`` of one token per row from this rank's vocabulary shard (collective over TP).

    Args:
        logits_shard: ``[N, V/tp]`` or ``[s, b, V/tp]`` logits (fp64, fp32, bf16 or fp16); rank r of ``tp_group``
            holds ids ``[r V/tp, (r+1) V/tp)``.
        token_ids: ``[N]`` (or ``[s, b]``) global ids ``y``, tokens (below ``real_vocab_size``).
        tp_group: tensor-parallel group; ``None``: the vocabulary is not split (TP=1).
        temperature: the distribution is ``softmax(logits / temperature)`` (the sampler's temperature, so that
            the log-prob is comparable with the rollout engine's).
        real_vocab_size: ids at or past it are padding rows of the table: no probability, no gradient.

    Returns:
        ``[N]`` (or ``[s, b]``) log-probs in fp32 (fp64 for fp64 logits), the same on every rank, differentiable
        with respect to ``logits_shard`` (exact analytic backward, no autograd through the collective).

    Raises:
        ValueError: bad temperature, ids that are not tokens, or shapes that do not fit together.
    """
    temperature = check_temperature(temperature)
    vocab_local = logits_shard.shape[-1]
    lead = logits_shard.shape[:-1]
    logits = logits_shard.reshape(-1, vocab_local)
    layout = ShardLayout.of(tp_group, vocab_local, real_vocab_size)
    ids = check_token_ids(token_ids.to(logits.device), logits.shape[0], layout.tokens)
    return _TokenLogprobs.apply(logits, ids, layout, temperature).reshape(lead)


def fused_vocab_parallel_token_logprobs(
    hidden: torch.Tensor,
    output_weight_shard: torch.Tensor,
    token_ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    *,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
    chunk_size: int | None = None,
    all_reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """:func:`vocab_parallel_token_logprobs` of ``hidden @ output_weight_shard^T``, chunked over tokens: the
    ``[N, V/tp]`` logits never exist; the backward recomputes each chunk's logits.

    Args:
        hidden: ``[N, h]`` or ``[s, b, h]`` last hidden states, the same on every rank of ``tp_group``.
        output_weight_shard: ``[V/tp, h]`` this rank's rows of the output-layer weight (same dtype as ``hidden``).
        token_ids, tp_group, temperature, real_vocab_size: as for :func:`vocab_parallel_token_logprobs`.
        chunk_size, all_reduce_hidden_grad: see :class:`~megatron_gkd.losses.fused.FusedOptions` (``None``: its
            default chunk).

    Returns:
        ``[N]`` (or ``[s, b]``) log-probs as :func:`vocab_parallel_token_logprobs`; the gradient flows to both
        ``hidden`` and ``output_weight_shard`` (padding rows of the weight get 0).

    Raises:
        ValueError: as :func:`vocab_parallel_token_logprobs`, or hidden and weight that do not fit together.
    """
    temperature = check_temperature(temperature)
    fused = FusedOptions(all_reduce_hidden_grad=all_reduce_hidden_grad) if chunk_size is None else \
        FusedOptions(chunk_size=chunk_size, all_reduce_hidden_grad=all_reduce_hidden_grad)
    check_hidden_and_weight(hidden, output_weight_shard)
    lead = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    layout = ShardLayout.of(tp_group, output_weight_shard.shape[0], real_vocab_size)
    ids = check_token_ids(token_ids.to(hidden.device), flat_hidden.shape[0], layout.tokens)
    return _FusedTokenLogprobs.apply(flat_hidden, output_weight_shard, ids, layout, fused, temperature).reshape(lead)
