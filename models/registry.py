"""Registry of supported HF architectures, keyed by ``config.json``'s ``architectures[0]``.

An entry is an :class:`ArchitectureSpec`: four functions of the HF config dict. Register one with
:func:`register_architecture` at import time of its module (see ``models/__init__.py`` for the
walk-through of adding an architecture).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_gkd.models.hf_config import architecture_name
from megatron_gkd.registry import Registry


def default_layer_spec(config, *, use_transformer_engine: bool, vp_stage: int | None, pp_rank: int | None):
    """Megatron's GPT decoder-block spec (dense/MoE layers by ``config.moe_layer_freq``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_transformer_engine,
        normalization=config.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchitectureSpec:
    """How to build and map one HF architecture.

    Attributes:
        name: the HF ``architectures[0]`` string, e.g. ``"LlamaForCausalLM"``.
        transformer_config: HF config -> model fields of the ``TransformerConfig`` (no parallel sizes,
            no dtypes: the builder adds ``state.config.transformer_config_kwargs()`` and those).
        gpt_model_kwargs: HF config -> ``GPTModel`` keyword arguments (``vocab_size``,
            ``max_sequence_length``, rotary settings, ``share_embeddings_and_output_weights``).
        weight_rules: HF config -> the :class:`~megatron_gkd.models.mapping.WeightRule` list.
        layer_spec: ``(config, use_transformer_engine=, vp_stage=, pp_rank=)`` -> the decoder block
            spec of one chunk; Megatron's GPT block spec unless the architecture needs its own modules.
        config_class: the ``TransformerConfig`` class to instantiate (``MLATransformerConfig`` for MLA).
    """

    name: str
    transformer_config: Callable[[dict], dict]
    gpt_model_kwargs: Callable[[dict], dict]
    weight_rules: Callable[[dict], list]
    layer_spec: Callable = default_layer_spec
    config_class: Callable | None = None


ARCHITECTURES: Registry[ArchitectureSpec] = Registry("HF architecture", config_key="architectures[0]")


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    """Adds ``spec`` to the registry; a second registration of the same name is a programming error."""
    return ARCHITECTURES.register(spec.name, spec)


def supported_architectures() -> list[str]:
    return ARCHITECTURES.names()


def get_architecture(hf_config_or_name: dict | str) -> ArchitectureSpec:
    """The registered spec for an HF config (or an architecture name).

    Raises:
        ValueError: the architecture is not supported; the message lists the supported ones.
    """
    name = hf_config_or_name if isinstance(hf_config_or_name, str) else architecture_name(hf_config_or_name)
    return ARCHITECTURES.get(name)
