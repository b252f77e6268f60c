"""Every weight tensor of a model, with how tensor / expert parallelism splits it, and the counts.

The inventory lists each tensor once per layer (routed experts once per expert kind, multiplied by
the number of experts) with the dimension tensor parallelism splits. Megatron-Core and vLLM split a few
tensors differently; :class:`Engine` names the two:

* Megatron (``megatron_gkd.models`` builds): MLA's latent down-projections are column-parallel
  (split over TP, outputs gathered); experts split over expert-parallel ranks and, inside, over
  expert-tensor-parallel ranks; with tied embeddings and several pipeline stages the last stage keeps
  its own copy of the embedding as the output layer.
* vLLM: MLA's down-projections are replicated; key/value heads are replicated when TP exceeds their
  number; with expert parallelism the experts split over all ranks of the engine (TP x DP) and are
  not TP-split; the vocabulary is padded to a multiple of 64.

Parameters are what ``model.parameters()`` counts (a tied embedding once); ``buffer`` tensors (the
router's score-correction bias) are state the checkpoint stores but nothing trains.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from megatron_gkd.planning.model import ModelShape

MEGATRON, VLLM = "megatron", "vllm"
VLLM_VOCAB_PADDING = 64


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One weight tensor (per layer; per routed expert when ``per_expert``)."""

    name: str
    shape: tuple[int, ...]
    group: str
    """Report group: embedding, attention, mlp, experts, shared_experts, router, norms, output, mtp."""
    tp_dim: int | None = None
    """The dimension tensor parallelism splits (expert tensors: expert-tensor parallelism)."""
    per_expert: bool = False
    buffer: bool = False
    quantized: bool = False
    """A linear weight of a decoder layer: 8-bit (FP8 with block scales, or int8) in quantised
    checkpoints and engines; embeddings, norms, routers and the output layer stay 16-bit."""
    replicated_in_vllm: bool = False
    """MLA down-projections: vLLM replicates them, Megatron splits them."""
    kv_heads: int = 0
    """Key/value projections: the number of heads (vLLM replicates heads when TP exceeds it)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _norm(name: str, size: int, group: str = "norms") -> TensorSpec:
    return TensorSpec(name, (size,), group)


def _gqa_attention(m: ModelShape) -> list[TensorSpec]:
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_key_value_heads
    tensors = [
        TensorSpec("self_attn.q_proj.weight", (a * d, h), "attention", 0, quantized=True),
        TensorSpec("self_attn.k_proj.weight", (g * d, h), "attention", 0, quantized=True, kv_heads=g),
        TensorSpec("self_attn.v_proj.weight", (g * d, h), "attention", 0, quantized=True, kv_heads=g),
        TensorSpec("self_attn.o_proj.weight", (h, a * d), "attention", 1, quantized=True),
    ]
    if m.qkv_bias:
        tensors += [
            TensorSpec("self_attn.q_proj.bias", (a * d,), "attention", 0),
            TensorSpec("self_attn.k_proj.bias", (g * d,), "attention", 0, kv_heads=g),
            TensorSpec("self_attn.v_proj.bias", (g * d,), "attention", 0, kv_heads=g),
        ]
    if m.qk_norm:
        tensors += [_norm("self_attn.q_norm.weight", d, "attention"), _norm("self_attn.k_norm.weight", d, "attention")]
    return tensors


def _mla_attention(m: ModelShape) -> list[TensorSpec]:
    h, a = m.hidden_size, m.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    tensors = [
        TensorSpec(
            "self_attn.kv_a_proj_with_mqa.weight",
            (m.kv_lora_rank + m.qk_rope_head_dim, h),
            "attention",
            0,
            quantized=True,
            replicated_in_vllm=True,
        ),
        _norm("self_attn.kv_a_layernorm.weight", m.kv_lora_rank, "attention"),
        TensorSpec(
            "self_attn.kv_b_proj.weight",
            (a * (m.qk_nope_head_dim + m.head_dim), m.kv_lora_rank),
            "attention",
            0,
            quantized=True,
        ),
        TensorSpec("self_attn.o_proj.weight", (h, a * m.head_dim), "attention", 1, quantized=True),
    ]
    if m.q_lora_rank is None:
        return tensors + [TensorSpec("self_attn.q_proj.weight", (a * qk, h), "attention", 0, quantized=True)]
    return tensors + [
        TensorSpec(
            "self_attn.q_a_proj.weight", (m.q_lora_rank, h), "attention", 0, quantized=True, replicated_in_vllm=True
        ),
        _norm("self_attn.q_a_layernorm.weight", m.q_lora_rank, "attention"),
        TensorSpec("self_attn.q_b_proj.weight", (a * qk, m.q_lora_rank), "attention", 0, quantized=True),
    ]


def _swiglu(prefix: str, h: int, ffn: int, group: str, per_expert: bool = False) -> list[TensorSpec]:
    return [
        TensorSpec(prefix + "gate_proj.weight", (ffn, h), group, 0, per_expert=per_expert, quantized=True),
        TensorSpec(prefix + "up_proj.weight", (ffn, h), group, 0, per_expert=per_expert, quantized=True),
        TensorSpec(prefix + "down_proj.weight", (h, ffn), group, 1, per_expert=per_expert, quantized=True),
    ]


def layer_tensors(m: ModelShape, moe: bool) -> list[TensorSpec]:
    """The tensors of one decoder layer (``moe``: routed experts instead of a dense MLP)."""
    h = m.hidden_size
    tensors = [_norm("input_layernorm.weight", h), _norm("post_attention_layernorm.weight", h)]
    tensors += _mla_attention(m) if m.attention == "mla" else _gqa_attention(m)
    if not moe:
        return tensors + _swiglu("mlp.", h, m.ffn_hidden_size, "mlp")
    tensors.append(TensorSpec("mlp.gate.weight", (m.num_experts, h), "router"))
    if m.router_expert_bias:
        tensors.append(TensorSpec("mlp.gate.e_score_correction_bias", (m.num_experts,), "router", buffer=True))
    tensors += _swiglu("mlp.experts.{expert}.", h, m.moe_ffn_hidden_size, "experts", per_expert=True)
    if m.shared_expert_ffn_hidden_size:
        tensors += _swiglu("mlp.shared_experts.", h, m.shared_expert_ffn_hidden_size, "shared_experts")
    return tensors


def embedding_tensor(m: ModelShape) -> TensorSpec:
    return TensorSpec("model.embed_tokens.weight", (m.vocab_size, m.hidden_size), "embedding", 0)


def output_tensors(m: ModelShape) -> list[TensorSpec]:
    """Final norm and, when untied, the output layer (on the last pipeline stage)."""
    tensors = [_norm("model.norm.weight", m.hidden_size)]
    if not m.tie_word_embeddings:
        tensors.append(TensorSpec("lm_head.weight", (m.vocab_size, m.hidden_size), "output", 0))
    return tensors


def mtp_tensors(m: ModelShape) -> list[TensorSpec]:
    """One multi-token-prediction module, without the embedding and head it shares with the model.

    DeepSeek-V3: norms of the embedding and of the hidden state, a projection of their
    concatenation, one more MoE layer, and the shared head's norm.
    """
    h = m.hidden_size
    extra = [
        _norm("enorm.weight", h, "mtp"),
        _norm("hnorm.weight", h, "mtp"),
        TensorSpec("eh_proj.weight", (h, 2 * h), "mtp", 0),
        _norm("shared_head.norm.weight", h, "mtp"),
    ]
    return extra + layer_tensors(m, moe=m.is_moe)


def _count(tensors: Iterable[TensorSpec], num_experts: int, buffers: bool = False) -> int:
    return sum(t.numel * (num_experts if t.per_expert else 1) for t in tensors if t.buffer == buffers)


@dataclasses.dataclass(frozen=True, slots=True)
class ParameterCounts:
    """Whole-model counts (no parallelism)."""

    total: int
    """Parameters of the main model (a tied embedding once), as ``model.parameters()`` counts them."""
    activated: int
    """Parameters one token uses: everything but the routed experts it is not sent to."""
    embedding: int
    buffers: int
    """Checkpoint state that is not a parameter (router score-correction biases)."""
    mtp: int
    """Unique parameters of the multi-token-prediction modules (not the shared embedding and head)."""
    mtp_layers_only: int
    """The MTP modules' decoder layers alone."""
    mtp_activated: int
    """Activated parameters of one MTP pass including the shared embedding and head (no projection)."""
    checkpoint_elements: int
    """Every stored element of an HF checkpoint: main model, MTP modules with their own copies of the
    embedding and head, buffers and, for FP8 checkpoints, the per-block ``weight_scale_inv``."""
    by_group: dict


def _fp8_scales(tensors: Iterable[TensorSpec], block: tuple[int, int] | None, num_experts: int) -> int:
    if block is None:
        return 0
    return sum(
        math.ceil(t.shape[0] / block[0]) * math.ceil(t.shape[1] / block[1]) * (num_experts if t.per_expert else 1)
        for t in tensors
        if t.quantized
    )


def model_tensors(m: ModelShape) -> list[tuple[TensorSpec, int]]:
    """``(tensor, copies)`` for the main model: per-layer tensors counted over the layers."""
    dense = layer_tensors(m, moe=False) if m.num_moe_layers < m.num_layers else []
    sparse = layer_tensors(m, moe=True) if m.is_moe else []
    return (
        [(embedding_tensor(m), 1)]
        + [(t, m.num_layers - m.num_moe_layers) for t in dense]
        + [(t, m.num_moe_layers) for t in sparse]
        + [(t, 1) for t in output_tensors(m)]
    )


def count_parameters(m: ModelShape) -> ParameterCounts:
    """Total, activated, MTP and checkpoint counts of the whole model."""
    experts, topk = m.num_experts, m.moe_router_topk
    main = model_tensors(m)
    total = sum(_count([t], experts) * n for t, n in main)
    buffers = sum(_count([t], experts, buffers=True) * n for t, n in main)
    idle_experts = sum(t.numel * (experts - topk) * n for t, n in main if t.per_expert)
    by_group: dict[str, int] = {}
    for t, n in main:
        if not t.buffer:
            by_group[t.group] = by_group.get(t.group, 0) + _count([t], experts) * n
    mtp = mtp_tensors(m)
    mtp_layer = layer_tensors(m, moe=m.is_moe)
    mtp_unique = _count(mtp, experts) * m.num_mtp_layers
    head = m.vocab_size * m.hidden_size
    mtp_activated = 0
    if m.num_mtp_layers:
        layer_active = _count(mtp_layer, experts) - sum(t.numel * (experts - topk) for t in mtp_layer if t.per_expert)
        mtp_activated = m.num_mtp_layers * layer_active + 2 * head
    checkpoint = total + buffers  # a tied embedding is stored once
    checkpoint += m.num_mtp_layers * (_count(mtp, experts) + _count(mtp, experts, buffers=True) + 2 * head)
    scales = sum(_fp8_scales([t], m.fp8_block, experts) * n for t, n in main)
    scales += m.num_mtp_layers * _fp8_scales(mtp, m.fp8_block, experts)
    return ParameterCounts(
        total=total,
        activated=total - idle_experts,
        embedding=m.vocab_size * m.hidden_size,
        buffers=buffers,
        mtp=mtp_unique,
        mtp_layers_only=_count(mtp_layer, experts) * m.num_mtp_layers,
        mtp_activated=mtp_activated,
        checkpoint_elements=checkpoint + scales,
        by_group=by_group,
    )


def padded_vocab(m: ModelShape, engine: str, tp: int) -> int:
    """The vocabulary rows an engine allocates (vLLM pads to a multiple of 64, then splits by TP)."""
    if engine == VLLM:
        return math.ceil(m.vocab_size / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    return m.vocab_size


def shard_elements(
    t: TensorSpec, m: ModelShape, *, engine: str, tp: int, ep: int, etp: int
) -> int:
    """Elements of ``t`` on one rank (all of this rank's experts for a routed-expert tensor)."""
    if t.per_expert:
        local_experts = m.num_experts // ep
        split = 1 if engine == VLLM and ep > 1 else (etp if engine == MEGATRON else tp)
        per_expert = t.numel // split if t.tp_dim is not None else t.numel
        return local_experts * per_expert
    if t.tp_dim is None or (engine == VLLM and t.replicated_in_vllm):
        return t.numel
    if engine == VLLM and t.kv_heads and tp > t.kv_heads:
        return t.numel // t.kv_heads  # one (replicated) head per rank
    return t.numel // tp
