"""Megatron-Core model providers per Hugging Face architecture and the HF <-> Megatron mapping.

Public API (call :func:`megatron_gkd.parallel.initialize` first)::

    chunks = load_hf("path/to/hf", dtype=torch.bfloat16)   # this rank's GPTModel per VPP chunk
    for hf_name, tensor in export_hf_weights(chunks): ...  # full HF tensors on their owner rank
    save_hf(chunks, "path/to/out")                          # safetensors + config + tokenizer files
    chunks = build_model(read_hf_config("path/to/hf"))      # random init, same layout and mapping
    hf_dir = resolve_checkpoint("model.Q4_1.gguf", dtype="float32")   # a GGUF as a cached HF directory

Every function here that takes a checkpoint path also takes a GGUF file (or a directory holding one): it is
dequantized into a cached HF directory first (:func:`resolve_checkpoint`, the one place paths become directories).

Supported architectures are registered by their ``config.json`` ``architectures[0]`` string; any other
raises ``ValueError`` listing :func:`supported_architectures`.

Adding an architecture
----------------------
Write a module (``models/<family>.py``) that registers an :class:`ArchitectureSpec` at import, and
import it at the bottom of this file. The spec is four functions of the HF config dict:

``transformer_config(hf) -> dict``
    The model fields of Megatron's ``TransformerConfig`` (layers, sizes, heads, norms, MoE fields).
    Not the parallel sizes nor dtypes: :func:`build_model` adds ``state.config.transformer_config_kwargs()``
    and ``params_dtype`` itself. Set ``config_class`` for another config class (``MLATransformerConfig``).
``gpt_model_kwargs(hf) -> dict``
    ``GPTModel`` kwargs: ``vocab_size``, ``max_sequence_length``, ``position_embedding_type`` and rotary
    settings, ``share_embeddings_and_output_weights``. ``pre_process``/``post_process``/``vp_stage``
    are the builder's.
``weight_rules(hf) -> list[WeightRule]``
    One :class:`WeightRule` per Megatron parameter::

        WeightRule(megatron=("decoder.layers.{layer}.mlp.linear_fc1.weight",),   # alternatives: local, TE
                   hf=("model.layers.{layer}.mlp.gate_proj.weight",
                       "model.layers.{layer}.mlp.up_proj.weight"),
                   tp_dims=(0, 0),        # per HF tensor: the dim TP slices along; None = replicated
                   fusion=Concat(2))      # HF TP slices -> Megatron TP shard, and back

    ``{layer}`` is the global layer index, ``{expert}`` the global expert index (such rules split over
    the expert-TP group). The fusion must commute with TP slicing: fusing rank r's slices of the HF
    tensors gives rank r's Megatron shard. :class:`Identity`, :class:`Concat` and :class:`QKVFusion`
    cover the dense/MoE families; subclass :class:`Fusion` (``fuse`` / ``split``) for new layouts.
    Every parameter must match a rule (else ``ValueError``); buffers (e.g. a router's expert bias)
    are mapped when a rule matches them. ``export=False`` marks tensors HF does not store.
``layer_spec(config, *, use_transformer_engine, vp_stage, pp_rank)`` (optional)
    The decoder block spec of one chunk; defaults to Megatron's GPT block spec (TE or local).

``llama.py`` holds the reusable Llama-style pieces (``dense_transformer_config``,
``dense_gpt_model_kwargs``, ``embedding_rules``, ``attention_rules``, ``dense_mlp_rules``); ``qwen.py``
shows how a family varies them (qkv bias, q/k norm, routed experts). ``deepseek_v3.py`` shows an
architecture with its own modules: a ``layer_spec`` (multi-latent attention with
``attention.SDPAttention`` as the core attention when Transformer Engine is absent, and the TP gradient
fixes of ``mla.py``) and ``config_class`` (``MLATransformerConfig``).
"""

from megatron_gkd.models.builder import HFModelInfo, build_model, parallel_state_of, transformer_config, unwrap
from megatron_gkd.models.checkpoints import cache_root, resolve_checkpoint
from megatron_gkd.models.export import (
    commit_output,
    export_hf_shards,
    export_hf_weights,
    partial_output,
    save_hf,
    shard_sources,
    write_hf,
)
from megatron_gkd.models.hf_config import read_hf_config
from megatron_gkd.models.loading import SafetensorsCheckpoint, load_hf
from megatron_gkd.models.mapping import (
    Concat,
    Fusion,
    Identity,
    QKVFusion,
    WeightRule,
    global_name,
    mapped_tensors,
    shard_coordinates,
)
from megatron_gkd.models.registry import (
    ArchitectureSpec,
    get_architecture,
    register_architecture,
    supported_architectures,
)

# Architecture modules register themselves on import.
from megatron_gkd.models import deepseek_v3, llama, qwen  # noqa: E402,F401  isort: skip

__all__ = [
    "ArchitectureSpec",
    "Concat",
    "Fusion",
    "HFModelInfo",
    "Identity",
    "QKVFusion",
    "SafetensorsCheckpoint",
    "WeightRule",
    "build_model",
    "cache_root",
    "commit_output",
    "export_hf_shards",
    "shard_sources",
    "export_hf_weights",
    "get_architecture",
    "global_name",
    "load_hf",
    "mapped_tensors",
    "partial_output",
    "read_hf_config",
    "register_architecture",
    "resolve_checkpoint",
    "save_hf",
    "write_hf",
    "parallel_state_of",
    "shard_coordinates",
    "supported_architectures",
    "transformer_config",
    "unwrap",
]
