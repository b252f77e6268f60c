"""``LlamaForCausalLM`` and the Llama-style building blocks that the Qwen families reuse.

The functions here are the pattern for a new dense decoder: a ``TransformerConfig`` field dict, the
``GPTModel`` kwargs (vocabulary, RoPE, tied embeddings) and the weight rules, each a function of the
HF config dict.
"""

from __future__ import annotations

import torch

from megatron_gkd.models.hf_config import get, head_dim, rope_settings
from megatron_gkd.models.mapping import Concat, QKVFusion, WeightRule
from megatron_gkd.models.registry import ArchitectureSpec, register_architecture

LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."

# Megatron's llama3 RoPE scaling fixes these three values (rotary_pos_embedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _reject(hf_config: dict, key: str, name: str) -> None:
    if hf_config.get(key):
        raise ValueError(f"{name} with {key}=true is not supported; the supported checkpoints set {key}: false")


def dense_transformer_config(hf_config: dict) -> dict:
    """``TransformerConfig`` fields of a Llama-style decoder (RMSNorm, SwiGLU, RoPE, GQA, no biases)."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is")
    heads = hf_config["num_attention_heads"]
    return dict(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=get(hf_config, "num_key_value_heads", default=heads),
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=get(hf_config, "rms_norm_eps", default=1e-6),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
    )


def rope_model_kwargs(hf_config: dict) -> dict:
    """``GPTModel`` RoPE kwargs for the scaling variants of these families (default, linear, llama3).

    Raises:
        ValueError: another scaling type, or llama3 parameters Megatron's implementation does not take.
    """
    rope = rope_settings(hf_config)
    theta = int(rope.theta) if float(rope.theta).is_integer() else rope.theta
    kwargs = dict(position_embedding_type="rope", rotary_base=theta)
    if rope.rope_type == "default":
        return kwargs
    if rope.rope_type == "linear":
        return {**kwargs, "seq_len_interpolation_factor": float(rope.params["factor"])}
    if rope.rope_type == "llama3":
        for key, value in _MEGATRON_LLAMA3_ROPE.items():
            if float(rope.params.get(key, value)) != value:
                raise ValueError(
                    f"llama3 RoPE scaling with {key}={rope.params[key]} is not supported; Megatron-Core "
                    f"implements {_MEGATRON_LLAMA3_ROPE}"
                )
        return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(rope.params["factor"])}
    raise ValueError(f"RoPE scaling type {rope.rope_type!r} is not supported; supported: default, linear, llama3")


def dense_gpt_model_kwargs(hf_config: dict) -> dict:
    """``GPTModel`` kwargs: vocabulary, maximum length, RoPE, tied embeddings."""
    return dict(
        vocab_size=hf_config["vocab_size"],
        max_sequence_length=get(hf_config, "max_position_embeddings", default=4096),
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        **rope_model_kwargs(hf_config),
    )


def embedding_rules(hf_config: dict) -> list[WeightRule]:
    """Word embeddings, final norm, output layer (the embedding itself when tied)."""
    tied = bool(hf_config.get("tie_word_embeddings", False))
    return [
        WeightRule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), (0,)),
        WeightRule(("decoder.final_layernorm.weight",), ("model.norm.weight",), (None,)),
        # Tied: the last pipeline stage keeps its own copy of the embedding as output_layer.weight;
        # it loads from the embedding and is not exported (HF stores the tensor once).
        WeightRule(
            ("output_layer.weight",),
            ("model.embed_tokens.weight" if tied else "lm_head.weight",),
            (0,),
            export=not tied,
        ),
    ]


def attention_rules(hf_config: dict, *, qkv_bias: bool = False, qk_norm: bool = False) -> list[WeightRule]:
    """Self-attention of one layer: input norm, fused qkv (GQA), output projection, optional q/k norms."""
    heads = hf_config["num_attention_heads"]
    groups = get(hf_config, "num_key_value_heads", default=heads)
    fusion = QKVFusion(head_dim=head_dim(hf_config), heads_per_group=heads // groups)
    attn = HF_LAYER + "self_attn."
    rules = [
        # TE fuses the input norm into linear_qkv.
        WeightRule(
            (LAYER + "input_layernorm.weight", LAYER + "self_attention.linear_qkv.layer_norm_weight"),
            (HF_LAYER + "input_layernorm.weight",),
            (None,),
        ),
        WeightRule(
            (LAYER + "self_attention.linear_qkv.weight",),
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            (0, 0, 0),
            fusion,
        ),
        WeightRule((LAYER + "self_attention.linear_proj.weight",), (attn + "o_proj.weight",), (1,)),
    ]
    if qkv_bias:
        rules.append(
            WeightRule(
                (LAYER + "self_attention.linear_qkv.bias",),
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                (0, 0, 0),
                fusion,
            )
        )
    if qk_norm:
        rules += [
            WeightRule((LAYER + "self_attention.q_layernorm.weight",), (attn + "q_norm.weight",), (None,)),
            WeightRule((LAYER + "self_attention.k_layernorm.weight",), (attn + "k_norm.weight",), (None,)),
        ]
    return rules


def pre_mlp_norm_rule() -> WeightRule:
    # TE fuses the norm into linear_fc1 of a dense MLP; MoE layers keep pre_mlp_layernorm.
    return WeightRule(
        (LAYER + "pre_mlp_layernorm.weight", LAYER + "mlp.linear_fc1.layer_norm_weight"),
        (HF_LAYER + "post_attention_layernorm.weight",),
        (None,),
    )


def dense_mlp_rules() -> list[WeightRule]:
    """SwiGLU MLP: fc1 = ``[gate; up]`` (each TP-split), fc2 = down (row-parallel)."""
    mlp = HF_LAYER + "mlp."
    return [
        pre_mlp_norm_rule(),
        WeightRule((LAYER + "mlp.linear_fc1.weight",), (mlp + "gate_proj.weight", mlp + "up_proj.weight"), (0, 0), Concat(2)),
        WeightRule((LAYER + "mlp.linear_fc2.weight",), (mlp + "down_proj.weight",), (1,)),
    ]


def llama_transformer_config(hf_config: dict) -> dict:
    _reject(hf_config, "attention_bias", "LlamaForCausalLM")
    _reject(hf_config, "mlp_bias", "LlamaForCausalLM")
    return dense_transformer_config(hf_config)


def llama_weight_rules(hf_config: dict) -> list[WeightRule]:
    return embedding_rules(hf_config) + attention_rules(hf_config) + dense_mlp_rules()


LLAMA = register_architecture(
    ArchitectureSpec(
        name="LlamaForCausalLM",
        transformer_config=llama_transformer_config,
        gpt_model_kwargs=dense_gpt_model_kwargs,
        weight_rules=llama_weight_rules,
    )
)
