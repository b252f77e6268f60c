"""The weight-sync plan (meta-info): every HF tensor the trainer will send, built once at start-up.

Each entry names one Hugging Face tensor with its full shape and dtype, where it lives in the trainer
(pipeline rank, virtual-pipeline chunk, the TP dimension it is split along, the global expert id) and
the Megatron -> HF transform that produces it: the :class:`~megatron_gkd.models.WeightRule` of the
models package (its Megatron template, the part of the fused tensor, the fusion and its parameters).
The plan is built from the same walk as :func:`megatron_gkd.models.export_hf_weights`, so the order
of entries on an owner rank is the order in which that exporter yields them; ``owner`` is the global
rank on which the exporter yields the tensor (``owner_only=True``).

All ranks build it from one all-gather and check that their digests agree; it serialises to JSON
(no pickle), so a receiver in another process or job gets it once, in a handshake.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.distributed as dist

from megatron_gkd.models import mapped_tensors, parallel_state_of, shard_coordinates, unwrap
from megatron_gkd.models.export import _is_owner, holds_shard

_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor of the plan.

    Attributes:
        name: HF tensor name (what vLLM's ``load_weights`` expects).
        shape: full (gathered) shape.
        dtype: dtype as sent (``"float32"``, ``"bfloat16"``...).
        pp_rank: pipeline stage that holds it.
        vpp_chunk: virtual-pipeline chunk on that stage.
        tp_dim: dimension split by tensor (or expert-tensor) parallelism; ``None`` if replicated.
        tp_size: size of the group that splits it.
        expert: global expert id of a routed-expert tensor, else ``None``.
        megatron: global Megatron parameter name it is cut from.
        part: index of this tensor among the HF tensors of its rule (q/k/v, gate/up).
        fusion: the rule's fusion, ``{"type": class name, **parameters}``.
        position: index in the exporter's walk on the owner rank (the same on every rank of a stage).
        owner: global trainer rank on which the gathering exporter yields it whole (colocated sync).
        shards: global trainer rank that holds (and sends) each slice along ``tp_dim``, in order; one
            rank for a tensor that is not split (its owner).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    pp_rank: int
    vpp_chunk: int
    tp_dim: int | None
    tp_size: int
    expert: int | None
    megatron: str
    part: int
    fusion: dict
    position: int
    owner: int
    shards: tuple[int, ...] = ()

    @property
    def num_shards(self) -> int:
        return max(len(self.shards), 1)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of one slice (the full shape for a tensor that is not split)."""
        if self.num_shards == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] //= self.num_shards
        return tuple(shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.torch_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class WeightSyncPlan:
    """The ordered entries and the trainer world they were built on."""

    entries: tuple[TensorSpec, ...]
    trainer_world_size: int
    logits_rank: int = 0
    """A trainer rank of the last pipeline stage (it shares the student's log-probs for ``verify``)."""

    def to_json(self) -> str:
        return json.dumps(
            {"trainer_world_size": self.trainer_world_size, "logits_rank": self.logits_rank,
             "entries": [dataclasses.asdict(e) for e in self.entries]},
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> "WeightSyncPlan":
        data = json.loads(text)
        entries = tuple(
            TensorSpec(**{**entry, "shape": tuple(entry["shape"]), "shards": tuple(entry["shards"])}) for entry in data["entries"]
        )
        return cls(entries=entries, trainer_world_size=data["trainer_world_size"], logits_rank=data["logits_rank"])

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @property
    def num_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self.entries)

    @property
    def owners(self) -> list[int]:
        """Ranks on which the gathering exporter yields whole tensors."""
        return sorted({entry.owner for entry in self.entries})

    @property
    def senders(self) -> list[int]:
        """Ranks that send slices in the distributed layout."""
        return sorted({rank for entry in self.entries for rank in entry.shards})


def _fusion_description(fusion) -> dict:
    return {"type": type(fusion).__name__, **{k: v for k, v in vars(fusion).items() if not k.startswith("_")}}


def local_entries(chunks) -> list[dict]:
    """This rank's view of the plan: every HF tensor its chunks export, ``owner`` set where it owns it.

    No communication and no copies (shapes come from the fusion applied to meta tensors).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    entries, position = [], 0
    for vpp_chunk, chunk in enumerate(chunks):
        model, state = unwrap(chunk), parallel_state_of(chunk)
        for megatron_name, tensor, rule, fields in mapped_tensors(model, model.hf_model_info.rules):
            if not rule.export:
                continue
            _, shard_rank, size = shard_coordinates(rule, state)
            slices = rule.to_hf(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
            for part, (hf_name, piece, dim) in enumerate(zip(rule.hf_names(fields), slices, rule.tp_dims)):
                shape = list(piece.shape)
                if dim is not None and size > 1:
                    shape[dim] *= size
                owns = _is_owner(hf_name, rule.is_expert, shard_rank, size, state)
                split = dim is not None and size > 1
                holds = holds_shard(hf_name, rule.is_expert, dim, shard_rank, size, state)
                entries.append(
                    dict(
                        name=hf_name,
                        shape=tuple(shape),
                        dtype=str(tensor.dtype).removeprefix("torch."),
                        pp_rank=state.pp_rank,
                        vpp_chunk=vpp_chunk,
                        tp_dim=dim,
                        tp_size=size,
                        expert=int(fields["expert"]) if "expert" in fields else None,
                        megatron=megatron_name,
                        part=part,
                        fusion=_fusion_description(rule.fusion),
                        position=position,
                        owner=rank if owns else -1,
                        shard=(shard_rank if split else 0) if holds else -1,
                    )
                )
                position += 1
    return entries


def build_plan(chunks, group: dist.ProcessGroup | None = None) -> WeightSyncPlan:
    """The plan of the whole trainer (collective over ``group``, default: the world of the trainer).

    Raises:
        RuntimeError: ranks disagree on the plan, or a tensor has no owner or two.
    """
    state = parallel_state_of(chunks[0])  # the student's, which it was built on
    is_logits_rank = state.is_pipeline_last_stage and state.tp_rank == 0
    mine = (local_entries(chunks), is_logits_rank)
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        world = dist.get_world_size(group)
    else:
        gathered, world = [mine], 1
    logits_rank = min(rank for rank, (_, flag) in enumerate(gathered) if flag)
    gathered = [rank_entries for rank_entries, _ in gathered]
    owned: dict[str, dict] = {}
    shards: dict[str, dict[int, int]] = {}
    seen: set[str] = set()
    for rank, rank_entries in enumerate(gathered):
        for entry in rank_entries:
            seen.add(entry["name"])
            shard = entry.pop("shard")
            if shard >= 0:
                holders = shards.setdefault(entry["name"], {})
                if shard in holders:
                    raise RuntimeError(f"weight sync plan: slice {shard} of {entry['name']} is held by ranks {holders[shard]} and {rank}")
                holders[shard] = rank
            if entry["owner"] < 0:
                continue
            if entry["name"] in owned:
                raise RuntimeError(f"weight sync plan: {entry['name']} is owned by ranks "
                                   f"{owned[entry['name']]['owner']} and {entry['owner']}")
            owned[entry["name"]] = entry
    if missing := sorted(seen - set(owned)):
        raise RuntimeError(f"weight sync plan: no rank owns {missing[:5]} ({len(missing)} tensors)")
    for name, entry in owned.items():
        split = entry["tp_dim"] is not None and entry["tp_size"] > 1
        expected = list(range(entry["tp_size"] if split else 1))
        if sorted(shards.get(name, {})) != expected:
            raise RuntimeError(f"weight sync plan: {name} has slices {sorted(shards.get(name, {}))} held, expected {expected}")
        entry["shards"] = tuple(shards[name][i] for i in expected)
    # Exporter order on each owner; across owners by position, so that buckets complete in an order
    # that every rank of a stage reaches together (see buckets.layout_buckets).
    ordered = sorted(owned.values(), key=lambda e: (e["position"], e["pp_rank"], e["owner"]))
    plan = WeightSyncPlan(entries=tuple(TensorSpec(**e) for e in ordered), trainer_world_size=world, logits_rank=logits_rank)
    _check_agreement(plan, group)
    return plan


def _check_agreement(plan: WeightSyncPlan, group) -> None:
    if not dist.is_initialized():
        return
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, plan.digest, group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"weight sync plan differs between ranks: digests {digests}")
