"""Activation memory of one micro-batch, per layer and rank: what autograd saves for the backward pass.

The reasoning is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), which Megatron's own ``--recompute-*`` options come from: walk a layer's operators, list the
tensors each keeps for its backward, and note which of them tensor parallelism splits (head- and
FFN-parallel regions: always), which sequence parallelism splits (norms, residual and the inputs of
column-parallel linears: with ``sequence_parallel``) and which it leaves whole (MLA's latents).
Their paper counts a GPT-3 layer with GELU, dropout and LayerNorm; this module counts today's layers
(RMSNorm, SwiGLU, GQA or MLA, routed experts, no dropout) for two kernel sets:

* ``fused`` (Transformer Engine / MindSpeed): norm fused into the next linear (input + normalised
  output + ``rstd``), flash attention (q, k, v, output, log-sum-exp; no ``s x s`` matrix), fused SwiGLU
  (FC1 output + FC2 input), grouped-GEMM experts;
* ``local`` (Megatron's local spec, the CPU path): torch RMSNorm (float32 input and normalised copy),
  unfused attention (GQA keys/values expanded to every head, the float32 softmax ``[b, a, s, s]``),
  unfused SwiGLU, sequential experts that also keep their routing-probability product.

The ``local`` terms were read off the saved-tensor hooks of real Megatron-Core layers on the CPU; the
memory check (``benchmarks/planner_memory.py``) compares the whole plan with measured peaks.

Counted: saved activations of every layer (with the local kernels also RoPE tables and the causal
mask), the loss's saved tensors on the last stage, the router's per-token state. Not counted: dropout
masks (dropout is 0 in distillation), FP8 activation copies (activations are counted at
``act_bytes``), communication buffers of the collectives.
"""

from __future__ import annotations

import dataclasses

from megatron_gkd.planning.model import ModelShape

ALWAYS, SEQUENCE, WHOLE = "tp", "sp", "none"
"""How a term splits over tensor-parallel ranks: always, only with sequence parallelism, never."""


@dataclasses.dataclass(frozen=True, slots=True)
class Term:
    """A tensor saved for backward, per token of the micro-batch."""

    name: str
    elements: float
    """Elements per token before any split (``s`` factors included for attention matrices)."""
    split: str
    bytes_per_element: int

    def bytes_per_token(self, tp: int, sequence_parallel: bool) -> float:
        divisor = tp if self.split == ALWAYS or (self.split == SEQUENCE and sequence_parallel) else 1
        return self.elements * self.bytes_per_element / divisor


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """What a term list depends on besides the model."""

    seq_length: int
    act_bytes: int
    kernels: str
    micro_batch_size: int = 1
    selective_recompute: bool = False
    """Megatron's selective recomputation of the core attention: its inputs (q, k, v) are kept, what
    it saves inside (the score matrix, expanded keys/values, flash's log-sum-exp) is rebuilt."""


def _norm_terms(name: str, width: int, ctx: Context) -> list[Term]:
    if ctx.kernels == "local":
        # torch's composite RMSNorm keeps a float32 input and the float32 normalised tensor.
        return [Term(name, 2 * width, SEQUENCE, 4), Term(name + ".rstd", 1, SEQUENCE, 4)]
    # A fused norm + linear keeps its input, the normalised output (the linear's input) and rstd.
    return [Term(name, width, SEQUENCE, ctx.act_bytes), Term(name + ".rstd", 1, SEQUENCE, 4)]


def _linear_input(name: str, width: int, ctx: Context) -> list[Term]:
    # The input a column-parallel linear keeps (the norm's output; with sequence parallelism the local
    # shard, gathered again in the backward).
    return [Term(name, width, SEQUENCE, ctx.act_bytes)]


def _rotary_terms(rotary_dim: int, ctx: Context) -> list[Term]:
    """Local kernels: the float32 cos/sin tables each layer's RoPE keeps for q and k (``[s, d]`` four
    times, not per sample) and the boolean causal mask (``[s, s]``). Fused kernels keep neither."""
    if ctx.kernels == "fused":
        return []
    per_token = (4 * rotary_dim * 4 + ctx.seq_length) / ctx.micro_batch_size
    return [Term("rope_and_mask", per_token, WHOLE, 1)]


def _softmax_terms(heads: int, ctx: Context) -> list[Term]:
    if ctx.selective_recompute:
        return []
    if ctx.kernels == "fused":
        return [Term("attention.lse", heads, ALWAYS, 4)]
    # Megatron's softmax runs in float32 and keeps its output; in half precision the matmul with V
    # keeps the half copy too.
    terms = [Term("attention.probs", heads * ctx.seq_length, ALWAYS, 4)]
    if ctx.act_bytes < 4:
        terms.append(Term("attention.probs_half", heads * ctx.seq_length, ALWAYS, ctx.act_bytes))
    return terms


def gqa_attention_terms(m: ModelShape, ctx: Context) -> list[Term]:
    a, g, d, b = m.num_attention_heads, m.num_key_value_heads, m.head_dim, ctx.act_bytes
    terms = _norm_terms("input_norm", m.hidden_size, ctx) + _linear_input("qkv.input", m.hidden_size, ctx)
    if m.qk_norm:
        qkv = (a + 2 * g) * d
        # local: q copied out of the fused qkv output, normalised copies of q and k, and the qkv output
        # itself (k's norm keeps a view of it); fused: the norms keep the qkv output.
        local = 2 * a * d + qkv + g * d
        if ctx.kernels == "local":
            terms.append(Term("qk_norm", local, ALWAYS, 4))  # torch norms work in float32
        else:
            terms.append(Term("qk_norm", qkv, ALWAYS, b))
    # Local attention expands keys and values to every head; flash attention (and the inputs a
    # selective-recompute checkpoint keeps) have the groups.
    kv_heads = a if ctx.kernels == "local" and not ctx.selective_recompute else g
    terms += [Term("attention.q", a * d, ALWAYS, b), Term("attention.kv", 2 * kv_heads * d, ALWAYS, b)]
    terms += _softmax_terms(a, ctx) + _rotary_terms(d, ctx)
    return terms + [Term("proj.input", a * d, ALWAYS, b)]


def mla_attention_terms(m: ModelShape, ctx: Context) -> list[Term]:
    a, b = m.num_attention_heads, ctx.act_bytes
    qk, latent = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
    norm_bytes = 4 if ctx.kernels == "local" else b
    terms = _norm_terms("input_norm", m.hidden_size, ctx) + _linear_input("down_proj.input", m.hidden_size, ctx)
    # Latents are gathered over TP before their norms: whole on every rank.
    if m.q_lora_rank:
        terms.append(Term("q_latent", 3 * m.q_lora_rank, WHOLE, norm_bytes))  # norm in, normalised, up-proj in
    terms.append(Term("kv_latent", (latent + m.qk_rope_head_dim) + 2 * latent, WHOLE, norm_bytes))
    terms += [
        Term("attention.q", a * qk, ALWAYS, b),
        Term("attention.k", a * qk, ALWAYS, b),
        Term("attention.v", a * m.head_dim, ALWAYS, b),
    ]
    terms += _softmax_terms(a, ctx) + _rotary_terms(m.qk_rope_head_dim, ctx)
    return terms + [Term("proj.input", a * m.head_dim, ALWAYS, b)]


def _swiglu_terms(name: str, ffn: float, ctx: Context) -> list[Term]:
    # local: FC1 output [gate; up], silu(gate), the up copy (up + glu offset), FC2's input.
    # fused: FC1 output and FC2's input.
    factor = 5 if ctx.kernels == "local" else 3
    return [Term(name, factor * ffn, ALWAYS, ctx.act_bytes)]


def dense_mlp_terms(m: ModelShape, ctx: Context) -> list[Term]:
    return (
        _norm_terms("pre_mlp_norm", m.hidden_size, ctx)
        + _linear_input("fc1.input", m.hidden_size, ctx)
        + _swiglu_terms("mlp", m.ffn_hidden_size, ctx)
    )


def moe_terms(m: ModelShape, ctx: Context, *, routed_tokens: float, etp: int) -> list[Term]:
    """An MoE layer's MLP half; ``routed_tokens``: expert inputs on this rank per micro-batch token
    (:func:`routed_tokens_per_token`, already per rank, hence ``WHOLE``)."""
    b, h, f = ctx.act_bytes, m.hidden_size, m.moe_ffn_hidden_size
    # local sequential experts also keep the activation output scaled by the routing probability.
    per_copy = (6 if ctx.kernels == "local" else 3) * f / etp
    terms = _norm_terms("pre_mlp_norm", h, ctx) + _linear_input("router.input", h, ctx)
    # Router logits / probabilities / routing map over all experts and the top-k indices (bytes / token).
    terms.append(Term("router", (10 * m.num_experts + 32 * m.moe_router_topk) / b, SEQUENCE, b))
    terms.append(Term("experts", routed_tokens * (h + per_copy + 1), WHOLE, b))
    if m.shared_expert_ffn_hidden_size:
        terms += _swiglu_terms("shared_experts", m.shared_expert_ffn_hidden_size, ctx)
    return terms


def final_terms(m: ModelShape, ctx: Context, loss: str) -> list[Term]:
    """The last stage after the decoder: final norm, output layer input and the loss's saved tensors."""
    terms = _norm_terms("final_norm", m.hidden_size, ctx) + _linear_input("output.input", m.hidden_size, ctx)
    if loss == "cross_entropy":
        # Megatron's vocab-parallel cross entropy keeps the float32 softmax of the logit shard.
        terms.append(Term("loss.softmax", m.vocab_size, ALWAYS, 4))
    elif loss == "distill":
        # The divergence keeps the [s, b, v/tp] logits and recomputes exp() in the backward.
        terms.append(Term("loss.logits", m.vocab_size, ALWAYS, ctx.act_bytes))
    return terms


def layer_bytes_per_token(terms: list[Term], tp: int, sequence_parallel: bool) -> float:
    return sum(t.bytes_per_token(tp, sequence_parallel) for t in terms)


def checkpoint_input_bytes_per_token(m: ModelShape, ctx: Context, tp: int, sequence_parallel: bool) -> float:
    """What full recomputation keeps of a layer group: its input hidden state."""
    return m.hidden_size * ctx.act_bytes / (tp if sequence_parallel else 1)


def routed_tokens_per_token(m: ModelShape, *, tp: int, etp: int, sequence_parallel: bool, imbalance: float) -> float:
    """Expert inputs on one rank per token of the micro-batch, balanced routing times ``imbalance``.

    A rank routes its tokens (``1/tp`` of them with sequence parallelism); each goes to ``topk``
    experts, spread over the expert-parallel ranks, which receive as many copies as they send; an
    expert-TP group gathers its members' copies.
    """
    local = 1 / tp if sequence_parallel else 1
    return local * m.moe_router_topk * etp * imbalance
