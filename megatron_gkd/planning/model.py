"""The shape of a model, read from its Hugging Face ``config.json`` dict, as the planner needs it.

No ``transformers`` and no torch: the planner runs wherever Python does (a GGUF file's config is the exception:
its metadata is parsed by ``transformers``). One :class:`ModelShape`
describes every supported architecture (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3): grouped-query or
multi-latent attention, a dense or routed MLP per layer, shared experts, multi-token-prediction
layers, and the checkpoint's FP8 block quantisation. Checkpoints written by different ``transformers``
releases spell a few keys differently (``num_experts`` / ``num_local_experts``); both are read.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_gkd.planning.gguf_config import gguf_file, read_gguf_config

SUPPORTED = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Sizes of one decoder-only model; every count the planner makes derives from these."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool
    attention: str
    """``gqa`` (separate q/k/v heads, grouped keys/values) or ``mla`` (DeepSeek multi-latent)."""
    num_attention_heads: int
    num_key_value_heads: int
    """Key/value heads (GQA); MLA expands keys and values to every head, so it equals the heads."""
    head_dim: int
    """Query/key/value head size (GQA); for MLA the value head size."""
    qkv_bias: bool = False
    qk_norm: bool = False
    q_lora_rank: int | None = None
    """MLA: rank of the low-rank query (``None``: a plain query projection)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    ffn_hidden_size: int = 0
    """Intermediate size of a dense (SwiGLU) MLP."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: routed experts (``True``) or a dense MLP."""
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    router_expert_bias: bool = False
    """DeepSeek-V3's score-correction bias: a float32 buffer per MoE layer, not a parameter."""
    num_mtp_layers: int = 0
    """Multi-token-prediction modules stored after the main layers (DeepSeek-V3: 1)."""
    fp8_block: tuple[int, int] | None = None
    """Block size of the checkpoint's FP8 weights (DeepSeek-V3 as released: 128 x 128), else ``None``."""
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention={self.attention!r}; choose 'gqa' or 'mla'")
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if any(self.moe_layers) and not (self.num_experts and self.moe_router_topk and self.moe_ffn_hidden_size):
            raise ValueError("MoE layers need num_experts, moe_router_topk and moe_ffn_hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def kv_cache_elements_per_token_per_layer(self) -> int:
        """Elements one token adds to one layer's KV cache, before tensor parallelism.

        GQA keeps a key and a value per key/value head; MLA keeps only the compressed latent and the
        shared rotary key, ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3).
        """
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim


def read_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` dict of an HF checkpoint directory, or of the JSON file itself, or the one a GGUF file's
    metadata describes (:mod:`megatron_gkd.planning.gguf_config`; nothing is converted)."""
    gguf = gguf_file(path)
    if gguf is not None:
        return read_gguf_config(gguf)
    path = os.fspath(path)
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no HF config at {file}; pass a Hugging Face checkpoint directory or its config.json")
    with open(file) as handle:
        return json.load(handle)


_MISSING = object()


def config_value(hf: dict, *keys: str, default=_MISSING):
    """The first of ``keys`` present (not None) in the config dict: releases of ``transformers`` spell some
    keys differently (``num_experts`` / ``num_local_experts``). The planner and ``megatron_gkd.models`` both
    read them through this one function.

    Raises:
        ValueError: none is present and no default was given.
    """
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    if default is _MISSING:
        raise ValueError(f"the HF config lacks {' / '.join(keys)}")
    return default


def gqa_head_dim(hf: dict) -> int:
    """Attention head size of a (grouped-query) attention config: explicit ``head_dim`` (Qwen3) or hidden size /
    heads."""
    return config_value(hf, "head_dim", default=None) or hf["hidden_size"] // hf["num_attention_heads"]


def _required(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"the HF config lacks {key!r}, which {hf['architectures'][0]} needs")
    return hf[key]


def _qwen3_moe_layers(hf: dict) -> tuple[bool, ...]:
    # HF: a layer is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th.
    dense = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step") or 1
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"]))


def _fp8_block(hf: dict) -> tuple[int, int] | None:
    quant = hf.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def model_shape(hf: dict) -> ModelShape:
    """The :class:`ModelShape` of an HF ``config.json`` dict.

    Raises:
        ValueError: the architecture is not supported (the message lists those that are), or a key
            the architecture needs is missing.
    """
    names = hf.get("architectures") or []
    if not names or names[0] not in SUPPORTED:
        raise ValueError(
            f"unsupported architecture {names[0] if names else None!r}; the planner knows {', '.join(SUPPORTED)}"
        )
    arch = names[0]
    layers = _required(hf, "num_hidden_layers")
    heads = _required(hf, "num_attention_heads")
    common = dict(
        architecture=arch,
        vocab_size=_required(hf, "vocab_size"),
        hidden_size=_required(hf, "hidden_size"),
        num_layers=layers,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_attention_heads=heads,
        ffn_hidden_size=hf.get("intermediate_size") or 0,
        max_position_embeddings=hf.get("max_position_embeddings") or 4096,
        fp8_block=_fp8_block(hf),
    )
    if arch == "DeepseekV3ForCausalLM":
        num_dense = min(hf.get("first_k_dense_replace") or 0, layers)
        experts = hf.get("n_routed_experts") or 0
        moe_ffn = hf.get("moe_intermediate_size") or 0
        return ModelShape(
            **common,
            attention="mla",
            num_key_value_heads=heads,
            head_dim=_required(hf, "v_head_dim"),
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=_required(hf, "kv_lora_rank"),
            qk_nope_head_dim=_required(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=_required(hf, "qk_rope_head_dim"),
            moe_layers=tuple(bool(experts) and i >= num_dense for i in range(layers)),
            num_experts=experts,
            moe_router_topk=hf.get("num_experts_per_tok") or 0,
            moe_ffn_hidden_size=moe_ffn,
            shared_expert_ffn_hidden_size=(hf.get("n_shared_experts") or 0) * moe_ffn,
            router_expert_bias=bool(experts),
            num_mtp_layers=hf.get("num_nextn_predict_layers") or 0,
        )
    moe = arch == "Qwen3MoeForCausalLM"
    return ModelShape(
        **common,
        attention="gqa",
        num_key_value_heads=config_value(hf, "num_key_value_heads", default=heads),
        head_dim=gqa_head_dim(hf),
        # Qwen2 always carries q/k/v biases; Llama and Qwen3 only with attention_bias (rejected by
        # megatron_gkd.models, counted here so that such configs still plan).
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        moe_layers=_qwen3_moe_layers(hf) if moe else (False,) * layers,
        num_experts=config_value(hf, "num_experts", "num_local_experts", default=0) if moe else 0,
        moe_router_topk=(hf.get("num_experts_per_tok") or 0) if moe else 0,
        moe_ffn_hidden_size=(hf.get("moe_intermediate_size") or 0) if moe else 0,
    )
