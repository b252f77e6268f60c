"""Megatron-Core's multi-latent attention with two tensor-parallel gradient errors fixed.

**1. The shared rotary key.**
In MLA every head uses the same rotary key ``k_pos_emb`` (the last ``qk_pos_emb_head_dim`` outputs of
``linear_kv_down_proj``), but tensor parallelism gives each rank only its own heads. When the down
projection is column-parallel (Megatron-Core 0.16.1's local spec, and our TE spec), MLA all-gathers its
output and splits off ``k_pos_emb``; the backward of that all-gather merely keeps this rank's slice of
the gradient, so the gradient of ``k_pos_emb`` (and through it of the down projection and of everything
before the attention) only counts this rank's heads. Nothing all-reduces it: TP=2 gives different
gradients from TP=1 (seen in ``tests/distributed/models/test_deepseek_v3_parallel.py`` before this fix).
Upstream's TE spec replicates the down projection and gets the sum from the sequence-parallel gather's
reduce-scatter, which is why the bug does not show there with sequence parallelism.

:class:`TensorParallelMLASelfAttention` keeps every computation of ``MLASelfAttention`` and, under TP,
routes the rotary part of the key through :class:`_SumRopeKeyGradOverTP`: identity forward; backward
adds to each local head's gradient its share of the other ranks' heads, so that the sum over this
rank's heads (which the head expansion's backward takes) is the sum over all heads.

**2. The query-latent norm.** ``finalize_model_grads`` *sums* over TP ranks the gradient of every
parameter whose name contains ``q_layernorm`` (meant for per-head q/k norms, whose heads are split).
MLA's ``q_layernorm`` normalises the gathered, replicated query latent, whose gradient is already
complete on every rank (the column-parallel up projection all-reduces it), so the sum doubles it at
TP=2. Without sequence parallelism its parameters are marked ``average_gradients_across_tp_domain``,
which ``finalize_model_grads`` checks first and averages instead (the average of equal gradients).
With sequence parallelism the latent is split along the sequence and the sum is right.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class _SumRopeKeyGradOverTP(torch.autograd.Function):
    """Identity on ``[..., heads, rope_dim]``; the backward makes each rank's head-sum the global one."""

    @staticmethod
    def forward(ctx, key_rope: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return key_rope.view_as(key_rope)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local = grad.sum(dim=-2, keepdim=True)  # this rank's heads
        total = local.clone()
        dist.all_reduce(total, group=ctx.group)  # every head of every rank
        return grad + (total - local) / grad.shape[-2], None


class TensorParallelMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rotary-key and query-latent-norm gradients are right under TP.

    Use it only with column-parallel ``linear_kv_down_proj`` (where upstream drops the other ranks'
    contributions); with a replicated down projection under sequence parallelism upstream already sums.
    """

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        if self.tp_group.size() > 1 and not config.sequence_parallel and config.q_lora_rank is not None:
            for param in self.q_layernorm.parameters():
                param.average_gradients_across_tp_domain = True

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        query, key, value, q_compressed, kv_compressed = super().get_query_key_value_tensors(
            hidden_states, *args, **kwargs
        )
        if self.tp_group.size() > 1 and value is not None and key.requires_grad:
            nope, rope = key.split([self.config.qk_head_dim, self.config.qk_pos_emb_head_dim], dim=-1)
            key = torch.cat([nope, _SumRopeKeyGradOverTP.apply(rope, self.tp_group)], dim=-1)
        return query, key, value, q_compressed, kv_compressed
