"""The sizes a pruned student keeps, resolved against the teacher's config and checked for validity.

A size is asked for as a count (``10``) or as a fraction of the teacher's (``0.5``); a size not asked for keeps
the teacher's. Attention keeps whole heads of ``head_dim`` channels, and grouped-query attention needs the same
number of query heads in every key/value group (transformers' ``repeat_kv``, vLLM and Megatron-Core all assume it),
so the kept head count is a multiple of the kept group count and no group grows. transformers 5's ``LlamaConfig``
refuses a ``hidden_size`` that is not a multiple of ``num_attention_heads`` even when ``head_dim`` is given, so a
Llama student's hidden size is one (a fraction is rounded to the nearest; a count that is not fails). Only dense
grouped-query decoders (Llama, Qwen2, Qwen3) are pruned: routed experts and multi-latent attention have other axes.
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_gkd.models.hf_config import head_dim
from megatron_gkd.planning import count_parameters, model_shape

logger = logging.getLogger(__name__)

# Architectures whose transformers config validates hidden_size % num_attention_heads == 0 (Qwen2's and Qwen3's do not).
_HIDDEN_DIVISIBLE_BY_HEADS = ("LlamaForCausalLM",)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSizes:
    """The axes pruning cuts, with Megatron's names."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    """``head_dim``: never pruned (a head is kept or dropped whole)."""
    architecture: str = ""

    @classmethod
    def of(cls, hf_config: dict) -> ModelSizes:
        """The sizes of an HF ``config.json`` dict.

        Raises:
            ValueError: the architecture is not a dense grouped-query decoder.
        """
        shape = model_shape(hf_config)
        if shape.attention != "gqa" or shape.is_moe:
            raise ValueError(f"{shape.architecture} has {'routed experts' if shape.is_moe else 'multi-latent attention'}; "
                             "pruning supports dense grouped-query decoders (Llama, Qwen2, Qwen3)")
        return cls(num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
                   num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_key_value_heads,
                   kv_channels=head_dim(hf_config), architecture=shape.architecture)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def parse_size(text: str) -> int | float:
    """A command-line size: ``"10"`` is a count, ``"0.5"`` a fraction of the teacher's size."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise ValueError(f"size {text!r} is neither a count (e.g. 10) nor a fraction (e.g. 0.5)") from None


@dataclasses.dataclass(kw_only=True, slots=True)
class PruneTargets:
    """What the student keeps; ``None`` keeps the teacher's size. A float in (0, 1] is a fraction of the
    teacher's size (rounded to the nearest count, at least 1), an int a count."""

    num_layers: int | float | None = None
    """Decoder layers kept (depth pruning: the least important layers are dropped)."""
    hidden_size: int | float | None = None
    """Hidden (embedding) channels kept: the embedding, every norm and every projection's hidden side."""
    ffn_hidden_size: int | float | None = None
    """MLP channels kept in every layer (each layer keeps its own most important ones)."""
    num_attention_heads: int | None = None
    """Query heads kept in every layer; a multiple of the kept query groups (default: the groups kept x the
    teacher's heads per group)."""
    num_query_groups: int | None = None
    """Key/value heads kept in every layer, each with its query heads (default: all: heads are pruned inside
    the groups, which keeps the KV cache and the tensor-parallel layouts the teacher loads in)."""

    def __post_init__(self):
        for name in ("num_attention_heads", "num_query_groups"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: give a count of whole heads (an integer >= 1)")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, float) and not 0.0 < value <= 1.0:
                raise ValueError(f"{name}={value}: a fraction lies in (0, 1]; give a count as an integer")
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{name}={value}: keep at least 1")

    @property
    def prunes_width(self) -> bool:
        return any(getattr(self, name) is not None for name in
                   ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups"))

    def resolve(self, teacher: ModelSizes) -> ModelSizes:
        """The student's sizes.

        Raises:
            ValueError: a size exceeds the teacher's, or the head counts are not valid for grouped-query attention
                (the message lists the valid ones).
        """
        groups = self.num_query_groups or teacher.num_query_groups
        if groups > teacher.num_query_groups:
            raise ValueError(f"num_query_groups={groups} exceeds the teacher's {teacher.num_query_groups}")
        heads = self.num_attention_heads or groups * teacher.heads_per_group
        valid = [groups * k for k in range(1, teacher.heads_per_group + 1)]
        if heads not in valid:
            raise ValueError(f"num_attention_heads={heads} with num_query_groups={groups}: grouped-query attention keeps "
                             f"the same number of query heads in each group, at most the teacher's "
                             f"{teacher.heads_per_group}; choose one of {valid}")
        multiple = heads if teacher.architecture in _HIDDEN_DIVISIBLE_BY_HEADS else 1
        hidden = _count("hidden_size", self.hidden_size, teacher.hidden_size, multiple)
        if hidden % multiple:
            below, above = hidden - hidden % multiple, hidden - hidden % multiple + multiple
            raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}, which "
                             f"transformers requires of {teacher.architecture}; choose e.g. "
                             f"{' or '.join(str(size) for size in (below, above) if 0 < size <= teacher.hidden_size)}")
        return dataclasses.replace(
            teacher,
            num_layers=_count("num_layers", self.num_layers, teacher.num_layers),
            hidden_size=hidden,
            ffn_hidden_size=_count("ffn_hidden_size", self.ffn_hidden_size, teacher.ffn_hidden_size),
            num_attention_heads=heads,
            num_query_groups=groups,
        )


def _count(name: str, asked: int | float | None, teacher: int, multiple: int = 1) -> int:
    """The count asked for; a fraction of ``teacher`` rounds to the nearest multiple of ``multiple``."""
    if asked is None:
        return teacher
    if isinstance(asked, float):
        count = max(1, round(asked * teacher / multiple)) * multiple
        count = count if count <= teacher else teacher - teacher % multiple
    else:
        count = asked
    if count > teacher:
        raise ValueError(f"{name}={count} exceeds the teacher's {teacher}; pruning only removes")
    return count


def pruned_hf_config(hf_config: dict, student: ModelSizes, kept_layers: list[int]) -> dict:
    """The teacher's ``config.json`` dict with the student's sizes.

    ``head_dim`` is written out: transformers derives it as ``hidden_size // num_attention_heads`` when absent,
    which is wrong once either changes. Per-layer lists (``layer_types``) keep the kept layers' entries.
    """
    config = dict(hf_config)
    config.update(num_hidden_layers=student.num_layers, hidden_size=student.hidden_size,
                  intermediate_size=student.ffn_hidden_size, num_attention_heads=student.num_attention_heads,
                  num_key_value_heads=student.num_query_groups, head_dim=student.kv_channels)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [hf_config["layer_types"][layer] for layer in kept_layers]
    return config


def parameter_count(hf_config: dict) -> int:
    """Parameters of the model of ``hf_config`` (a tied embedding once)."""
    return count_parameters(model_shape(hf_config)).total
