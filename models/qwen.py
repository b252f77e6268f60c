"""``Qwen2ForCausalLM`` (qkv bias), ``Qwen3ForCausalLM`` (q/k norm) and ``Qwen3MoeForCausalLM`` (routed experts).

Each is the Llama-style decoder of ``llama.py`` with one variation.
"""

from __future__ import annotations

import logging

from megatron_gkd import platform
from megatron_gkd.models.hf_config import get
from megatron_gkd.models.llama import (
    HF_LAYER,
    LAYER,
    attention_rules,
    dense_gpt_model_kwargs,
    dense_mlp_rules,
    dense_transformer_config,
    embedding_rules,
)
from megatron_gkd.models.mapping import Concat, WeightRule
from megatron_gkd.models.registry import ArchitectureSpec, register_architecture

logger = logging.getLogger(__name__)


def _reject_biases(hf_config: dict, name: str) -> None:
    if hf_config.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias=true is not supported; set attention_bias: false")


def _warn_sliding_window(hf_config: dict) -> None:
    if hf_config.get("use_sliding_window"):
        logger.warning("use_sliding_window=true is ignored: Megatron attends to the full causal context")


# --- Qwen2: q/k/v projections carry a bias -------------------------------------------------------


def qwen2_transformer_config(hf_config: dict) -> dict:
    _warn_sliding_window(hf_config)
    return {**dense_transformer_config(hf_config), "add_qkv_bias": True}


def qwen2_weight_rules(hf_config: dict) -> list[WeightRule]:
    return embedding_rules(hf_config) + attention_rules(hf_config, qkv_bias=True) + dense_mlp_rules()


# --- Qwen3: RMSNorm on each query and key head -----------------------------------------------------


def qwen3_transformer_config(hf_config: dict) -> dict:
    _reject_biases(hf_config, "Qwen3")
    _warn_sliding_window(hf_config)
    return {**dense_transformer_config(hf_config), "qk_layernorm": True}


def qwen3_weight_rules(hf_config: dict) -> list[WeightRule]:
    return embedding_rules(hf_config) + attention_rules(hf_config, qk_norm=True) + dense_mlp_rules()


# --- Qwen3-MoE: routed experts (softmax router, top-k), optional dense layers ----------------------


def moe_layer_pattern(hf_config: dict) -> list[int]:
    """1 for an MoE layer, 0 for a dense one (HF: not in ``mlp_only_layers`` and every ``decoder_sparse_step``)."""
    dense = set(hf_config.get("mlp_only_layers") or [])
    step = hf_config.get("decoder_sparse_step") or 1
    return [
        0 if layer in dense or (layer + 1) % step else 1 for layer in range(hf_config["num_hidden_layers"])
    ]


def default_token_dispatcher() -> str:
    """``alltoall`` on accelerators; ``allgather`` on the host, where the all-to-all dispatcher's
    device-to-host events do not exist (megatron-core 0.16.1 with the CPU adaptor)."""
    return "allgather" if platform.current().name == "cpu" else "alltoall"


def qwen3_moe_transformer_config(hf_config: dict) -> dict:
    fields = qwen3_transformer_config(hf_config)
    aux_loss = float(hf_config.get("router_aux_loss_coef") or 0.0)
    fields.update(
        num_moe_experts=get(hf_config, "num_experts", "num_local_experts"),
        moe_router_topk=hf_config["num_experts_per_tok"],
        moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
        moe_layer_freq=moe_layer_pattern(hf_config),
        # HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Megatron's default
        # (top-k of the logits, softmax over those) is the renormalised form; pre-softmax is the other.
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False),
        moe_router_load_balancing_type="aux_loss" if aux_loss > 0 else "none",
        moe_aux_loss_coeff=aux_loss,
        moe_token_dispatcher_type=default_token_dispatcher(),
        moe_grouped_gemm=False,
    )
    return fields


def routed_expert_rules() -> list[WeightRule]:
    """Router and experts; ``{expert}`` is global, each rank maps only its experts under EP.

    Local and TE sequential MLPs name experts ``local_experts.{j}.linear_fc1.weight``; TE grouped GEMM
    names them ``linear_fc1.weight{j}``.
    """
    expert = HF_LAYER + "mlp.experts.{expert}."
    return [
        WeightRule((LAYER + "mlp.router.weight",), (HF_LAYER + "mlp.gate.weight",), (None,)),
        WeightRule(
            (
                LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                LAYER + "mlp.experts.linear_fc1.weight{expert}",
            ),
            (expert + "gate_proj.weight", expert + "up_proj.weight"),
            (0, 0),
            Concat(2),
        ),
        WeightRule(
            (
                LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                LAYER + "mlp.experts.linear_fc2.weight{expert}",
            ),
            (expert + "down_proj.weight",),
            (1,),
        ),
    ]


def qwen3_moe_weight_rules(hf_config: dict) -> list[WeightRule]:
    # Dense layers (mlp_only_layers) keep the dense MLP rules; their names never match the expert ones.
    return (
        embedding_rules(hf_config)
        + attention_rules(hf_config, qk_norm=True)
        + dense_mlp_rules()
        + routed_expert_rules()
    )


QWEN2 = register_architecture(
    ArchitectureSpec(
        name="Qwen2ForCausalLM",
        transformer_config=qwen2_transformer_config,
        gpt_model_kwargs=dense_gpt_model_kwargs,
        weight_rules=qwen2_weight_rules,
    )
)
QWEN3 = register_architecture(
    ArchitectureSpec(
        name="Qwen3ForCausalLM",
        transformer_config=qwen3_transformer_config,
        gpt_model_kwargs=dense_gpt_model_kwargs,
        weight_rules=qwen3_weight_rules,
    )
)
QWEN3_MOE = register_architecture(
    ArchitectureSpec(
        name="Qwen3MoeForCausalLM",
        transformer_config=qwen3_moe_transformer_config,
        gpt_model_kwargs=dense_gpt_model_kwargs,
        weight_rules=qwen3_moe_weight_rules,
    )
)
