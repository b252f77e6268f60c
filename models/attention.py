"""A core-attention module for Megatron-Core layer specs that runs without Transformer Engine.

Megatron-Core 0.16.1's local ``DotProductAttention`` assumes that keys and values share one head size
(``config.kv_channels``) and rejects the ``k_channels`` / ``v_channels`` arguments that
``MultiLatentAttention`` passes (multi-latent attention has ``q/k`` heads of
``qk_head_dim + qk_pos_emb_head_dim`` and ``v`` heads of ``v_head_dim``); upstream relies on
Transformer Engine's attention there. :class:`SDPAttention` is a drop-in ``core_attention`` for any
spec: it takes the same constructor and forward arguments as ``DotProductAttention`` plus
``k_channels`` / ``v_channels``, and computes attention with ``torch.nn.functional.
scaled_dot_product_attention``, which picks a fused kernel where the device has one and a plain
matmul-softmax-matmul path on the CPU (float64 included, which the numerics tests use).

Tensor layouts are Megatron's: ``query [sq, b, np, hk]``, ``key [sk, b, ng, hk]``,
``value [sk, b, ng, hv]`` (``np`` query heads and ``ng`` key/value groups of this tensor-parallel
rank, ``np % ng == 0``: GQA/MQA), output ``[sq, b, np * hv]``. ``attention_mask`` follows Megatron's
convention: boolean, ``True`` marks a *masked* position, broadcastable to ``[b, np, sq, sk]``; when it
is given it replaces the causal mask (as in ``FusedScaleMaskSoftmax``), when it is ``None`` a causal
mask type gives a causal mask aligned to the last key (query i sees keys ``<= sk - sq + i``, which for
``sq == sk`` is the usual lower triangle and for a decode step ``sq == 1`` is no mask at all). A query
whose keys are all masked gets a zero output.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SDPAttention(MegatronModule):
    """Softmax attention with separate key and value head sizes, causal masking and GQA/MQA.

    Args:
        config: the transformer config (heads, query groups, dropout, parallel sizes).
        layer_number: 1-based layer number (kept for interface parity; the scale does not depend on it).
        attn_mask_type: the default mask type; ``causal`` / ``padding_causal`` build a causal mask when
            no ``attention_mask`` is passed.
        attention_type: ``"self"`` or ``"cross"`` (unused, as in ``DotProductAttention``).
        attention_dropout: overrides ``config.attention_dropout``.
        softmax_scale: multiplies ``q . k``; defaults to ``1 / sqrt(k_channels)``.
        k_channels: query/key head size; defaults to ``config.kv_channels``.
        v_channels: value head size; defaults to ``config.kv_channels``.
        cp_comm_type: must be ``None``-like; context parallelism needs Transformer Engine.
        pg_collection: process groups; only ``tp`` is used (heads are split over it).

    Raises:
        ValueError: a configuration this module does not implement (context parallelism, sliding
            windows, non-vanilla softmax, query-key layer scaling).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        _check_supported(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        tp_size = self.tp_group.size()
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attention output ``[sq, b, np * hv]`` for ``query [sq, b, np, hk]``, ``key [sk, b, ng, hk]``,
        ``value [sk, b, ng, hv]``."""
        if packed_seq_params is not None:
            raise ValueError(
                "SDPAttention does not support packed sequences (packed_seq_params); use the Transformer "
                "Engine layer spec for THD packing, or pass padded [s, b] batches"
            )
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, sk = query.shape[0], key.shape[0]
        # [s, b, heads, dim] -> [b, heads, s, dim], the layout scaled_dot_product_attention takes.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None  # scaled_dot_product_attention's boolean mask: True = may attend
        if attention_mask is not None:
            allowed = ~attention_mask.to(torch.bool)
        elif mask_type in _CAUSAL_TYPES and sq > 1:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        dropout_p = self.dropout_p if self.training else 0.0
        with _dropout_rng(self.config, dropout_p):
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                scale=self.softmax_scale,
                enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
            )
        # [b, np, sq, hv] -> [sq, b, np * hv]
        return context.permute(2, 0, 1, 3).reshape(sq, context.shape[0], -1)


def _check_supported(config: TransformerConfig) -> None:
    if config.context_parallel_size != 1:
        raise ValueError(
            "SDPAttention does not support context_parallel_size > 1; use the Transformer Engine spec"
        )
    if config.window_size is not None:
        raise ValueError("SDPAttention does not support sliding-window attention (window_size)")
    if config.softmax_type != "vanilla":
        raise ValueError(f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
    if config.apply_query_key_layer_scaling:
        raise ValueError(
            "SDPAttention does not implement apply_query_key_layer_scaling (an fp16 overflow guard); "
            "set apply_query_key_layer_scaling=False"
        )


def _dropout_rng(config: TransformerConfig, dropout_p: float):
    """The RNG context for attention dropout: Megatron's tracker, as ``DotProductAttention`` uses it.

    Heads are split over tensor-parallel ranks, so without sequence parallelism each rank forks the
    model-parallel RNG stream to drop different positions than its peers.
    """
    if dropout_p > 0.0 and not config.sequence_parallel:
        return tensor_parallel.get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()
