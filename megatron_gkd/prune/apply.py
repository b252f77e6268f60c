"""The kept indices applied to the teacher's HF tensors, as the exporter gathers them from the shards.

Each HF tensor of a dense grouped-query decoder has an axis per dimension that pruning may cut: the hidden
channels, the query heads (``head_dim`` rows each), the key/value groups, the MLP channels, or nothing (the
vocabulary, ``head_dim`` of the q/k norms). Every tensor is indexed along each of its axes, and a kept layer's
tensors are renamed to the student's layer number. A tied output layer is the embedding: HF stores it once, as
the embedding, so it stays tied. A tensor of any other name fails: pruning it would need rules nobody checked.
"""

from __future__ import annotations

import enum
import re
from typing import Iterator

import torch

from megatron_gkd.prune.selection import KeptIndices
from megatron_gkd.prune.targets import ModelSizes


class Axis(enum.Enum):
    """What a tensor dimension indexes."""

    HIDDEN = "hidden channels"
    HEADS = "query heads, head_dim rows each"
    GROUPS = "key/value groups, head_dim rows each"
    FFN = "MLP channels"


HIDDEN, HEADS, GROUPS, FFN = Axis.HIDDEN, Axis.HEADS, Axis.GROUPS, Axis.FFN
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Per HF tensor, what each of its dimensions indexes (None: kept whole).
_LAYER_AXES: dict[str, tuple[Axis | None, ...]] = {
    "input_layernorm.weight": (HIDDEN,),
    "post_attention_layernorm.weight": (HIDDEN,),
    "self_attn.q_proj.weight": (HEADS, HIDDEN),
    "self_attn.q_proj.bias": (HEADS,),
    "self_attn.k_proj.weight": (GROUPS, HIDDEN),
    "self_attn.k_proj.bias": (GROUPS,),
    "self_attn.v_proj.weight": (GROUPS, HIDDEN),
    "self_attn.v_proj.bias": (GROUPS,),
    "self_attn.o_proj.weight": (HIDDEN, HEADS),
    "self_attn.q_norm.weight": (None,),
    "self_attn.k_norm.weight": (None,),
    "mlp.gate_proj.weight": (FFN, HIDDEN),
    "mlp.up_proj.weight": (FFN, HIDDEN),
    "mlp.down_proj.weight": (HIDDEN, FFN),
}
_MODEL_AXES: dict[str, tuple[Axis | None, ...]] = {
    "model.embed_tokens.weight": (None, HIDDEN),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (None, HIDDEN),
}


class TensorPruner:
    """Cuts the teacher's HF tensors to the student's: ``pruner(name, tensor)`` -> ``(student name, tensor)`` or
    ``None`` for a dropped layer's tensor."""

    def __init__(self, kept: KeptIndices, teacher: ModelSizes):
        self.kept = kept
        self.head_dim = teacher.kv_channels
        self.student_layer = {layer: position for position, layer in enumerate(kept.layers)}

    def __call__(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        found = _LAYER.match(name)
        if found is None:
            return name, self._index(name, tensor, _axes(_MODEL_AXES, name, name), None)
        layer, rest = int(found.group(1)), found.group(2)
        if layer not in self.student_layer:
            return None
        position = self.student_layer[layer]
        student_name = f"model.layers.{position}.{rest}"
        return student_name, self._index(name, tensor, _axes(_LAYER_AXES, rest, name), position)

    def _index(self, name: str, tensor: torch.Tensor, axes: tuple[Axis | None, ...], position: int | None) -> torch.Tensor:
        if tensor.dim() != len(axes):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; pruning expects {len(axes)} dimensions")
        for dim, axis in enumerate(axes):
            if axis is not None:
                index = torch.tensor(self._rows(axis, position), dtype=torch.long, device=tensor.device)
                tensor = tensor.index_select(dim, index)
        return tensor

    def _rows(self, axis: Axis, position: int | None) -> list[int]:
        if axis is HIDDEN:
            return self.kept.hidden
        if axis is FFN:
            return self.kept.ffn[position]
        # Heads and key/value groups are blocks of head_dim rows.
        units = self.kept.heads[position] if axis is HEADS else self.kept.query_groups[position]
        return [unit * self.head_dim + row for unit in units for row in range(self.head_dim)]


def _axes(table: dict, key: str, name: str) -> tuple[Axis | None, ...]:
    if key not in table:
        raise ValueError(f"cannot prune HF tensor {name!r}: pruning knows the tensors of dense Llama, Qwen2 and Qwen3 "
                         "decoders only")
    return table[key]


def pruned_tensors(tensors: Iterator[tuple[str, torch.Tensor]], pruner: TensorPruner
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (HF name, full tensor) cut by ``pruner``; a dropped layer's tensors are left out."""
    for name, tensor in tensors:
        pruned = pruner(name, tensor)
        if pruned is not None:
            yield pruned
