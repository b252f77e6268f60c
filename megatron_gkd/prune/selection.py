"""Which layers and channels the student keeps: the most important ones, in the teacher's order.

* Layers: the ``num_layers`` highest depth scores, each ranked alone (what one layer's removal costs; neither score
  sees how removals add up).
* Hidden channels: one ranking for the whole model, over the norms of the layers kept (a dropped layer's norms no
  longer read the hidden state) and the final norm.
* Attention, per kept layer: query groups rank by the sum of their heads' scores; inside each kept group the
  highest-scoring query heads stay, the same number in every group.
* MLP channels, per kept layer: its own ``ffn_hidden_size`` highest.

Ties go to the lower index (a stable sort), so every rank and every run selects the same.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_gkd.prune.importance import Importance
from megatron_gkd.prune.targets import ModelSizes


@dataclasses.dataclass(frozen=True)
class KeptIndices:
    """Teacher indices of what the student keeps, ascending (the student's order); per-layer lists follow ``layers``."""

    layers: list[int]
    hidden: list[int]
    query_groups: list[list[int]]
    heads: list[list[int]]
    """Query heads (teacher numbering ``group x heads_per_group + j``) of each kept layer."""
    ffn: list[list[int]]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KeptIndices:
        return cls(**data)


def top(scores: torch.Tensor, count: int) -> list[int]:
    """The indices of the ``count`` highest ``scores``, ascending; ties to the lower index."""
    order = torch.argsort(scores, descending=True, stable=True)
    return sorted(order[:count].tolist())


def select_kept(importance: Importance, teacher: ModelSizes, student: ModelSizes) -> KeptIndices:
    """What ``student`` keeps of ``teacher``, by ``importance`` (the module docstring says how)."""
    layers = top(importance.layers, student.num_layers)
    groups, heads = [], []
    for layer in layers:
        kept_groups, kept_heads = _attention(importance.heads[layer], teacher, student)
        groups.append(kept_groups)
        heads.append(kept_heads)
    return KeptIndices(
        layers=layers,
        hidden=top(importance.hidden_scores(layers), student.hidden_size),
        query_groups=groups,
        heads=heads,
        ffn=[top(importance.ffn[layer], student.ffn_hidden_size) for layer in layers],
    )


def _attention(scores: torch.Tensor, teacher: ModelSizes, student: ModelSizes) -> tuple[list[int], list[int]]:
    """The query groups and the query heads one layer keeps, from its heads' ``[H]`` scores."""
    per_group = scores.view(teacher.num_query_groups, teacher.heads_per_group)
    groups = top(per_group.sum(dim=1), student.num_query_groups)
    heads = [group * teacher.heads_per_group + head for group in groups
             for head in top(per_group[group], student.heads_per_group)]
    return groups, heads
