"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) as a Megatron-Core ``GPTModel`` with multi-latent attention.

The HF config maps onto an ``MLATransformerConfig``: MLA with a low-rank query (``q_lora_rank``, or a
plain ``q_proj`` when it is ``None``) and a compressed key/value latent, decoupled RoPE dims, YaRN
scaling; routed experts with shared experts, a sigmoid router with the expert-score-correction bias,
group-limited top-k and the routed scaling factor; the first ``first_k_dense_replace`` layers dense.
Multi-token-prediction layers of the checkpoint are ignored.

Conventions checked against ``transformers``' ``modeling_deepseek_v3.py`` (5.19) and DeepSeek's
reference ``inference/model.py`` (the two agree with each other):

* **RoPE interleaving.** DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` of the
  ``qk_rope_head_dim`` dims (the reference uses ``view_as_complex`` on pairs; transformers'
  ``rope_interleave=True``, the default, de-interleaves to ``[x0, x2, ..; x1, x3, ..]`` and applies
  ``rotate_half``). Megatron's MLA does exactly that de-interleave whenever
  ``config.multi_latent_attention`` is set (``rope_utils._apply_rotary_pos_emb_bshd``), and leaves
  q and k in the same permuted order, so ``q . k`` matches. ``rope_interleave=False`` (rotate-half on
  the stored order) is therefore rejected rather than silently mis-rotated.
* **YaRN.** Both scale cos/sin by the concentration factor ``m(f, mscale) / m(f, mscale_all_dim)``
  with ``m(f, s) = 0.1 s ln f + 1`` (1 for real V3 configs, where both are 1.0), and both multiply the
  softmax scale ``1/sqrt(qk_nope + qk_rope)`` by ``m(f, mscale_all_dim)^2``. They differ only when
  ``mscale`` or ``mscale_all_dim`` is 0/absent: transformers then uses ``m(f, 1)`` for cos/sin, which
  Megatron gives for ``mscale=None``; :func:`deepseek_v3_transformer_config` translates accordingly.
  A missing ``factor`` is ``max_position_embeddings / original_max_position_embeddings``
  (transformers' rule). Megatron applies the softmax-scale factor even for plain RoPE, so
  ``mscale_all_dim`` is set to 0 there (no factor), as transformers does.
* **Group-limited routing.** Both score a group by the sum of its top scores (bias included) and keep
  ``topk_group`` groups, but transformers and the reference sum the top **2**, Megatron the top
  ``topk // topk_group`` (``moe_utils.group_limited_topk``). That is 8 // 4 = 2 for DeepSeek-V3; other
  settings are rejected when the grouping constrains anything (``1 < topk_group < n_group``).
* **Top-k normalisation.** Megatron's sigmoid router always renormalises the top-k weights, which is
  ``norm_topk_prob=True`` (V3's value); ``False`` with ``top_k > 1`` is rejected.
* **q/kv latent norms.** transformers builds ``q_a_layernorm`` / ``kv_a_layernorm`` with eps 1e-6
  regardless of ``rms_norm_eps``; Megatron uses ``layernorm_epsilon`` for every norm. Equal for V3
  (``rms_norm_eps=1e-6``); otherwise a warning is logged.

Without Transformer Engine, Megatron's local MLA spec cannot build (its ``DotProductAttention``
rejects ``k_channels``); :func:`deepseek_v3_layer_spec` puts :class:`~megatron_gkd.models.attention.
SDPAttention` there. With TE, the latent down-projections are column-parallel in both specs (TE's
default replicates them) so that one weight mapping serves both.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from megatron_gkd.models.hf_config import rope_settings
from megatron_gkd.models.llama import HF_LAYER, LAYER, dense_mlp_rules, embedding_rules
from megatron_gkd.models.mapping import Concat, WeightRule
from megatron_gkd.models.qwen import default_token_dispatcher, routed_expert_rules
from megatron_gkd.models.registry import ArchitectureSpec, register_architecture

logger = logging.getLogger(__name__)

_HF_LATENT_NORM_EPS = 1e-6


def _rope_fields(hf_config: dict) -> dict:
    settings = rope_settings(hf_config)
    rope = settings.params
    fields = dict(rotary_base=settings.theta, rotary_percent=1.0)
    if settings.rope_type == "default":
        # No YaRN: Megatron's MLA still multiplies the softmax scale by m(factor, mscale_all_dim)^2;
        # mscale_all_dim = 0 makes that 1, matching transformers (which scales only for non-default RoPE).
        return dict(fields, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if settings.rope_type != "yarn":
        raise ValueError(
            f"DeepseekV3ForCausalLM with RoPE type {settings.rope_type!r} is not supported; "
            "supported: default, yarn"
        )
    if rope.get("attention_factor") is not None:
        raise ValueError("YaRN attention_factor is not supported; remove it (DeepSeek-V3 uses mscale)")
    if rope.get("truncate", True) is False:
        raise ValueError("YaRN truncate=false is not supported; Megatron rounds the correction range")
    original = rope.get("original_max_position_embeddings") or hf_config["max_position_embeddings"]
    factor = rope.get("factor") or hf_config["max_position_embeddings"] / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    return dict(
        fields,
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        # transformers: cos/sin factor m(f, mscale)/m(f, mscale_all_dim) only when both are truthy,
        # else m(f, 1); Megatron computes m(f, 1) exactly when mscale is None.
        mscale=float(mscale) if (mscale and mscale_all_dim) else None,
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )


def _moe_fields(hf_config: dict) -> dict:
    num_layers = hf_config["num_hidden_layers"]
    num_dense = min(hf_config.get("first_k_dense_replace") or 0, num_layers)
    num_experts = hf_config.get("n_routed_experts")
    if not num_experts or num_dense == num_layers:
        return {}
    topk = hf_config["num_experts_per_tok"]
    if hf_config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func {hf_config['scoring_func']!r} is not supported; DeepSeek-V3 uses 'sigmoid'")
    if hf_config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            f"topk_method {hf_config['topk_method']!r} is not supported; DeepSeek-V3 checkpoints use 'noaux_tc'"
        )
    if topk > 1 and not hf_config.get("norm_topk_prob", True):
        raise ValueError(
            "norm_topk_prob=false with num_experts_per_tok > 1 is not supported: Megatron's sigmoid "
            "router always renormalises the top-k weights"
        )
    fields = dict(
        num_moe_experts=num_experts,
        moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        # Training keeps updating the bias by DeepSeek-V3's auxiliary-loss-free rule (sign of the load
        # error, moe_router_bias_update_rate, 1e-3 as in the paper); pass moe_router_bias_update_rate=0
        # as an override to freeze it.
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf_config.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",  # transformers routes in float32 whatever the model dtype
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=default_token_dispatcher(),
        moe_grouped_gemm=False,
        moe_layer_freq=[0] * num_dense + [1] * (num_layers - num_dense),
    )
    n_group, topk_group = hf_config.get("n_group") or 1, hf_config.get("topk_group") or 1
    if 1 < n_group and topk_group < n_group:
        if topk != 2 * topk_group:
            raise ValueError(
                f"group-limited routing with num_experts_per_tok={topk}, topk_group={topk_group} is not "
                "supported: transformers scores a group by its top-2 experts, Megatron by its top "
                "num_experts_per_tok // topk_group; they agree only when num_experts_per_tok == 2 * topk_group"
            )
        fields.update(moe_router_num_groups=n_group, moe_router_group_topk=topk_group)
    shared = hf_config.get("n_shared_experts") or 0
    if shared:
        fields["moe_shared_expert_intermediate_size"] = shared * hf_config["moe_intermediate_size"]
    return fields


def deepseek_v3_transformer_config(hf_config: dict) -> dict:
    """The model fields of an ``MLATransformerConfig`` for a DeepSeek-V3 HF config dict.

    Raises:
        ValueError: a setting Megatron-Core cannot reproduce (the message says which and why).
    """
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is")
    if hf_config.get("attention_bias"):
        raise ValueError("DeepseekV3ForCausalLM with attention_bias=true is not supported")
    if hf_config.get("rope_interleave", True) is False:
        raise ValueError(
            "rope_interleave=false is not supported: Megatron's MLA always rotates interleaved pairs, "
            "as DeepSeek-V3 checkpoints do (rope_interleave=true)"
        )
    heads = hf_config["num_attention_heads"]
    if hf_config.get("num_key_value_heads", heads) != heads:
        raise ValueError(
            f"num_key_value_heads={hf_config['num_key_value_heads']} != num_attention_heads={heads}: "
            "multi-latent attention expands keys and values to every head"
        )
    eps = hf_config.get("rms_norm_eps", 1e-6)
    if eps != _HF_LATENT_NORM_EPS:
        logger.warning(
            "rms_norm_eps=%g: transformers normalises the q/kv latents with eps 1e-6, Megatron with %g",
            eps,
            eps,
        )
    return dict(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=heads,
        q_lora_rank=hf_config.get("q_lora_rank"),
        kv_lora_rank=hf_config["kv_lora_rank"],
        qk_head_dim=hf_config["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf_config["qk_rope_head_dim"],
        v_head_dim=hf_config["v_head_dim"],
        kv_channels=hf_config["v_head_dim"],
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        qk_layernorm=True,  # the q and kv latent norms
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        rotary_interleaved=False,  # MLA de-interleaves itself (see the module docstring)
        init_method_std=hf_config.get("initializer_range", 0.02),
        **_rope_fields(hf_config),
        **_moe_fields(hf_config),
    )


def deepseek_v3_gpt_model_kwargs(hf_config: dict) -> dict:
    """``GPTModel`` kwargs. RoPE lives inside MLA, so the model-level rotary settings are unused."""
    return dict(
        vocab_size=hf_config["vocab_size"],
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
    )


def mla_transformer_config(**fields):
    """``MLATransformerConfig(**fields)``, imported on use (Megatron-Core loads after platform setup)."""
    from megatron.core.transformer import MLATransformerConfig

    return MLATransformerConfig(**fields)


def deepseek_v3_layer_spec(config, *, use_transformer_engine: bool, vp_stage=None, pp_rank=None):
    """The decoder-block spec of one chunk: MLA in every layer, dense or MoE MLP per ``moe_layer_freq``.

    Megatron's GPT block spec with these changes: the attention is
    :class:`~megatron_gkd.models.mla.TensorParallelMLASelfAttention` (two TP gradient fixes); without
    Transformer Engine the core attention is :class:`SDPAttention`; with it the q/kv
    down-projections are column-parallel (as in the local spec), so one weight mapping serves both.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_transformer_engine,
        normalization="RMSNorm",
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    from megatron_gkd.models.mla import TensorParallelMLASelfAttention  # deferred: mla.py imports megatron.core

    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        changes = dict(linear_q_down_proj=TEColumnParallelLinear, linear_kv_down_proj=TEColumnParallelLinear)
    else:
        from megatron_gkd.models.attention import SDPAttention  # deferred: attention.py imports megatron.core

        changes = dict(core_attention=SDPAttention)
    rebuilt: dict[int, object] = {}  # layers share spec objects; keep them shared
    layer_specs = []
    for layer in block.layer_specs:
        if id(layer) not in rebuilt:
            rebuilt[id(layer)] = _with_attention(layer, TensorParallelMLASelfAttention, changes)
        layer_specs.append(rebuilt[id(layer)])
    return dataclasses.replace(block, layer_specs=layer_specs)


def _with_attention(layer_spec, module: type, changes: dict):
    attention = layer_spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, module=module, submodules=dataclasses.replace(attention.submodules, **changes)
    )
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention)
    )


# --- HF <-> Megatron weight mapping -----------------------------------------------------------------
# Megatron's MLA tensors have the HF layouts: linear_kv_down_proj is kv_a_proj_with_mqa (kv_lora_rank
# latent rows, then the qk_rope_head_dim rotary-key rows), linear_q_up_proj / linear_q_proj hold per head
# [qk_nope rows; qk_rope rows] like q_b_proj / q_proj, linear_kv_up_proj per head [k_nope; v] like
# kv_b_proj. Column-parallel projections split rows (whole heads for the up projections), so every rule
# is an identity on TP slices. TE fuses the latent norms into the up projections (layer_norm_weight).


def mla_attention_rules(hf_config: dict) -> list[WeightRule]:
    attn, hf = LAYER + "self_attention.", HF_LAYER + "self_attn."
    rules = [
        WeightRule((LAYER + "input_layernorm.weight",), (HF_LAYER + "input_layernorm.weight",), (None,)),
        WeightRule((attn + "linear_kv_down_proj.weight",), (hf + "kv_a_proj_with_mqa.weight",), (0,)),
        WeightRule(
            (attn + "kv_layernorm.weight", attn + "linear_kv_up_proj.layer_norm_weight"),
            (hf + "kv_a_layernorm.weight",),
            (None,),
        ),
        WeightRule((attn + "linear_kv_up_proj.weight",), (hf + "kv_b_proj.weight",), (0,)),
        WeightRule((attn + "linear_proj.weight",), (hf + "o_proj.weight",), (1,)),
    ]
    if hf_config.get("q_lora_rank") is None:
        return rules + [WeightRule((attn + "linear_q_proj.weight",), (hf + "q_proj.weight",), (0,))]
    return rules + [
        WeightRule((attn + "linear_q_down_proj.weight",), (hf + "q_a_proj.weight",), (0,)),
        WeightRule(
            (attn + "q_layernorm.weight", attn + "linear_q_up_proj.layer_norm_weight"),
            (hf + "q_a_layernorm.weight",),
            (None,),
        ),
        WeightRule((attn + "linear_q_up_proj.weight",), (hf + "q_b_proj.weight",), (0,)),
    ]


def shared_expert_rules() -> list[WeightRule]:
    """Shared experts (a SwiGLU MLP beside the routed ones) and the router's score-correction bias."""
    shared = HF_LAYER + "mlp.shared_experts."
    return [
        WeightRule(
            (LAYER + "mlp.shared_experts.linear_fc1.weight",),
            (shared + "gate_proj.weight", shared + "up_proj.weight"),
            (0, 0),
            Concat(2),
        ),
        WeightRule((LAYER + "mlp.shared_experts.linear_fc2.weight",), (shared + "down_proj.weight",), (1,)),
        # A persistent float32 buffer on both sides (transformers keeps it in fp32 whatever the dtype).
        WeightRule((LAYER + "mlp.router.expert_bias",), (HF_LAYER + "mlp.gate.e_score_correction_bias",), (None,)),
    ]


def deepseek_v3_weight_rules(hf_config: dict) -> list[WeightRule]:
    # Dense layers (the first first_k_dense_replace) match dense_mlp_rules; MoE layers the expert rules
    # plus pre_mlp_layernorm, which dense_mlp_rules() also carries.
    return (
        embedding_rules(hf_config)
        + mla_attention_rules(hf_config)
        + dense_mlp_rules()
        + routed_expert_rules()
        + shared_expert_rules()
    )


DEEPSEEK_V3 = register_architecture(
    ArchitectureSpec(
        name="DeepseekV3ForCausalLM",
        transformer_config=deepseek_v3_transformer_config,
        gpt_model_kwargs=deepseek_v3_gpt_model_kwargs,
        weight_rules=deepseek_v3_weight_rules,
        layer_spec=deepseek_v3_layer_spec,
        config_class=mla_transformer_config,
    )
)
