"""The HF <-> Megatron weight mapping: one rule per Megatron parameter, used in both directions.

A :class:`WeightRule` names a Megatron parameter (by template, with ``{layer}`` and ``{expert}``
fields holding *global* indices), the Hugging Face tensors it is made of, the dimension along which
each HF tensor is split by tensor parallelism, and a :class:`Fusion` that turns the HF tensors into the
Megatron tensor and back. The fusion works on *tensor-parallel slices*: rank r reads slice r of every HF
tensor (``tp_dims``) and fuses them into exactly its own Megatron shard, and the exporter splits a
shard back into HF slices and gathers each along its ``tp_dims`` entry. So loading reads only what a
rank owns, exporting needs no knowledge of Megatron's shard layout, and the weight-sync subsystem can
call :meth:`WeightRule.to_megatron` / :meth:`WeightRule.to_hf` per tensor.

Example (Megatron's fused qkv with GQA: per query group ``[q heads of the group; k; v]``)::

    WeightRule(
        megatron=("decoder.layers.{layer}.self_attention.linear_qkv.weight",),
        hf=("model.layers.{layer}.self_attn.q_proj.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "model.layers.{layer}.self_attn.v_proj.weight"),
        tp_dims=(0, 0, 0),
        fusion=QKVFusion(head_dim=128, heads_per_group=4),
    )

A rule whose Megatron template contains ``{expert}`` is split over the expert-tensor-parallel group,
every other one over the tensor-parallel group. Several Megatron templates in one rule are alternative
spellings of the same tensor (local spec vs Transformer Engine spec); the first that matches wins.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch

_FIELD = re.compile(r"\{(layer|expert)\}")


class Fusion:
    """How HF tensors (TP slices) combine into one Megatron tensor (TP shard), and back.

    ``fuse(split(x)) == x`` and ``split(fuse(parts)) == parts`` bit for bit, and both commute with
    tensor-parallel slicing (fusing rank r's HF slices gives rank r's Megatron shard).
    """

    def fuse(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError


class Identity(Fusion):
    """One HF tensor is one Megatron tensor."""

    def fuse(self, parts):
        (part,) = parts
        return part

    def split(self, tensor):
        return [tensor]


class Concat(Fusion):
    """Megatron stacks the HF tensors along ``dim`` (the gated MLP's ``[gate; up]`` fc1).

    With a TP split along the same dim, rank r holds ``[gate_r; up_r]``: Megatron's layout.
    """

    def __init__(self, num_parts: int = 2, dim: int = 0):
        self.num_parts = num_parts
        self.dim = dim

    def fuse(self, parts):
        assert len(parts) == self.num_parts, (len(parts), self.num_parts)
        return torch.cat(list(parts), dim=self.dim)

    def split(self, tensor):
        return [part.contiguous() for part in tensor.chunk(self.num_parts, dim=self.dim)]


class QKVFusion(Fusion):
    """Separate q/k/v projections <-> Megatron's ``linear_qkv`` (weight ``[rows, h]`` or bias ``[rows]``).

    Megatron interleaves by query group: for each of the G groups, the group's ``heads_per_group`` query
    heads, then its key head, then its value head, ``head_dim`` rows each. Tensor parallelism splits
    whole groups, so TP slices of q, k and v (contiguous head ranges) fuse into the TP shard.
    """

    def __init__(self, head_dim: int, heads_per_group: int):
        self.head_dim = head_dim
        self.heads_per_group = heads_per_group

    def fuse(self, parts):
        q, k, v = parts
        groups = k.shape[0] // self.head_dim
        rest = tuple(q.shape[1:])
        q = q.reshape(groups, self.heads_per_group * self.head_dim, *rest)
        k = k.reshape(groups, self.head_dim, *rest)
        v = v.reshape(groups, self.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def split(self, tensor):
        rows = (self.heads_per_group + 2) * self.head_dim
        groups = tensor.shape[0] // rows
        rest = tuple(tensor.shape[1:])
        q, k, v = tensor.reshape(groups, rows, *rest).split(
            [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=1
        )
        return [part.reshape(-1, *rest).contiguous() for part in (q, k, v)]


IDENTITY = Identity()


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter (or persistent buffer) and the HF tensors it maps to.

    Attributes:
        megatron: name templates, relative to the ``GPTModel``, with global ``{layer}`` / ``{expert}``
            indices; alternatives for the local and the Transformer Engine spec.
        hf: HF tensor name templates with the same fields.
        tp_dims: per HF tensor, the dimension its tensor-parallel slices are taken along; ``None``
            when every rank holds the whole tensor (norms, router).
        fusion: HF slices <-> Megatron shard.
        export: ``False`` for tensors that HF does not store (the output layer of tied embeddings).
    """

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    tp_dims: tuple[int | None, ...]
    fusion: Fusion = IDENTITY
    export: bool = True

    def __post_init__(self):
        if isinstance(self.megatron, str) or isinstance(self.hf, str):
            raise TypeError("WeightRule.megatron and WeightRule.hf are tuples of templates, not strings")
        if len(self.tp_dims) != len(self.hf):
            raise ValueError(f"WeightRule for {self.megatron[0]}: {len(self.hf)} HF names but tp_dims {self.tp_dims}")
        object.__setattr__(self, "_patterns", tuple(_compile(template) for template in self.megatron))

    @property
    def is_expert(self) -> bool:
        """Split over the expert-tensor-parallel group (routed experts) rather than the TP group."""
        return "{expert}" in self.megatron[0]

    def match(self, global_name: str) -> dict[str, str] | None:
        """The template fields if ``global_name`` is this rule's parameter, else ``None``."""
        for pattern in self._patterns:
            found = pattern.fullmatch(global_name)
            if found:
                return found.groupdict()
        return None

    def hf_names(self, fields: dict[str, str]) -> list[str]:
        return [template.format(**fields) for template in self.hf]

    def to_megatron(self, hf_slices: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's Megatron shard from this rank's slices of the HF tensors."""
        return self.fusion.fuse(hf_slices)

    def to_hf(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's slices of the HF tensors from its Megatron shard (gather them along ``tp_dims``)."""
        return self.fusion.split(shard)


def _compile(template: str) -> re.Pattern:
    pieces = _FIELD.split(template)
    # re.split with one group alternates literal text and field names.
    regex = "".join(
        re.escape(piece) if i % 2 == 0 else f"(?P<{piece}>\\d+)" for i, piece in enumerate(pieces)
    )
    return re.compile(regex)


def tp_slice_index(shape: Sequence[int], dim: int | None, rank: int, size: int, name: str) -> tuple:
    """The index that selects TP slice ``rank`` of ``size`` along ``dim`` of a tensor of ``shape``.

    Raises:
        ValueError: the dimension does not split evenly.
    """
    if dim is None or size == 1:
        return tuple(slice(None) for _ in shape)
    if shape[dim] % size:
        raise ValueError(
            f"{name}: dimension {dim} of shape {tuple(shape)} does not split across {size} "
            "tensor-parallel ranks; choose a tensor_model_parallel_size that divides it"
        )
    step = shape[dim] // size
    index = [slice(None)] * len(shape)
    index[dim] = slice(rank * step, (rank + 1) * step)
    return tuple(index)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def global_name(model: torch.nn.Module, local_name: str) -> str:
    """``local_name`` of a ``GPTModel`` parameter with global layer and expert indices.

    Pipeline stages and virtual chunks number their layers from 0; expert parallelism numbers each
    rank's experts from 0 (``local_experts.j`` for the sequential MLP, ``weight{j}`` for grouped GEMM).
    """
    found = _LAYER.match(local_name)
    if found is None:
        return local_name
    layer = model.decoder.layers[int(found.group(1))]
    rest = found.group(2)
    for pattern in (_LOCAL_EXPERT, _GROUPED_EXPERT):
        expert = pattern.match(rest)
        if expert is not None:
            global_expert = layer.mlp.local_expert_indices[int(expert.group(2))]
            rest = f"{expert.group(1)}{global_expert}{expert.group(3) if pattern is _LOCAL_EXPERT else ''}"
            break
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


def find_rule(rules: Sequence[WeightRule], name: str) -> tuple[WeightRule, dict[str, str]] | None:
    """The first rule matching the global Megatron name ``name`` and its fields, or ``None``."""
    for rule in rules:
        fields = rule.match(name)
        if fields is not None:
            return rule, fields
    return None


def mapped_tensors(model: torch.nn.Module, rules: Sequence[WeightRule]):
    """``(global_name, tensor, rule, fields)`` for every parameter and mapped buffer of ``model``.

    Raises:
        ValueError: a parameter has no rule (the mapping is incomplete for this architecture).
    """
    for local, tensor in model.named_parameters():
        name = global_name(model, local)
        found = find_rule(rules, name)
        if found is None:
            raise ValueError(f"no HF mapping rule for Megatron parameter {name!r}")
        yield name, tensor, found[0], found[1]
    for local, tensor in model.named_buffers():
        name = global_name(model, local)
        found = find_rule(rules, name)
        if found is not None:
            yield name, tensor, found[0], found[1]


def shard_coordinates(rule: WeightRule, state):
    """``(group, rank, size)`` of the tensor-parallel group that splits ``rule``'s tensor on ``state`` (the
    model's :class:`~megatron_gkd.parallel.ParallelState`).

    Routed experts are split over the expert-tensor-parallel group, everything else over the
    tensor-parallel group.
    """
    if rule.is_expert:
        return state.etp_group, state.etp_rank, state.etp_size
    return state.tp_group, state.tp_rank, state.tp_size
