"""Megatron -> HF: full HF-named tensors from the shards, and an HF checkpoint on disk.

:func:`export_hf_weights` walks this rank's parameters in order, splits each shard into HF slices with
its :class:`~megatron_gkd.models.mapping.WeightRule`, and all-gathers every slice over the group that
splits it (TP, or expert TP for routed experts). Every rank must iterate it to the end, since the gathers
are collectives of those groups. :func:`save_hf` writes what each owner rank yields into its own
safetensors files (no rank holds more than one file's worth), then rank 0 writes the index, the
config and the tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import zlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_gkd.models.builder import parallel_state_of, unwrap
from megatron_gkd.models.checkpoints import resolve_checkpoint
from megatron_gkd.models.loading import INDEX_FILE
from megatron_gkd.models.mapping import WeightRule, mapped_tensors, shard_coordinates
from megatron_gkd.parallel import gather_tp

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def owner_shard_rank(hf_name: str, size: int) -> int:
    """The rank of the splitting group that yields ``hf_name``: spread by a stable hash of the name, so
    that every TP rank writes (and holds) a share of the gathered tensors, not rank 0 all of them."""
    return zlib.crc32(hf_name.encode()) % size


def _is_first_replica(is_expert: bool, state) -> bool:
    return (state.expert_dp_rank if is_expert else state.dp_cp_rank) == 0


def _is_owner(hf_name: str, is_expert: bool, shard_rank: int, size: int, state) -> bool:
    """One rank per tensor yields it: its owner shard rank in the first data-parallel replica (of ``state``, the
    model's :class:`~megatron_gkd.parallel.ParallelState`)."""
    return shard_rank == owner_shard_rank(hf_name, size) and _is_first_replica(is_expert, state)


def holds_shard(hf_name: str, is_expert: bool, tp_dim: int | None, shard_rank: int, size: int, state) -> bool:
    """Whether :func:`export_hf_shards` yields this rank's slice of ``hf_name``: every rank of the
    splitting group in the first replica for a split tensor, the owner alone for a replicated one."""
    if tp_dim is None or size == 1:
        return _is_owner(hf_name, is_expert, shard_rank, size, state)
    return _is_first_replica(is_expert, state)


def export_hf_weights(modules, *, owner_only: bool = True, all_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF tensor held by this rank's chunks.

    Every rank of the model must iterate to the end (the TP / expert-TP gathers are collectives).
    Tensors stay on the parameters' device and dtype (the model's ``params_dtype``: cast where the
    receiver wants another); a replicated tensor may share storage with its parameter, so copy before
    modifying.

    Args:
        modules: this rank's chunks (``GPTModel`` built by this package, possibly wrapped).
        owner_only: yield each tensor on one rank only (:func:`owner_shard_rank` of the group that
            splits it, in the first data-parallel replica); ``False`` yields on every rank that took
            part in the gather.
        all_experts: with ``owner_only=False``, also gather routed experts over the expert-parallel
            group, so that every rank yields every expert (a colocated rollout engine needs them all).
    """
    assert not (owner_only and all_experts), "all_experts yields every expert on every rank: pass owner_only=False"
    for chunk in modules:
        model, state = unwrap(chunk), parallel_state_of(chunk)
        for _, tensor, rule, fields in mapped_tensors(model, model.hf_model_info.rules):
            if not rule.export:
                continue
            group, rank, size = shard_coordinates(rule, state)
            slices = rule.to_hf(tensor.detach())
            full = [
                piece if dim is None or size == 1 else gather_tp(piece, dim, group)
                for piece, dim in zip(slices, rule.tp_dims)
            ]
            if all_experts and rule.is_expert:
                yield from _gather_experts(model, rule, fields, full, state)
                continue
            for hf_name, value in zip(rule.hf_names(fields), full):
                if not owner_only or _is_owner(hf_name, rule.is_expert, rank, size, state):
                    yield hf_name, value


def _gather_experts(model, rule: WeightRule, fields: dict, full: list[torch.Tensor],
                    state) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of expert ``fields["expert"]`` and of the experts that the other expert-parallel ranks hold
    at the same local index (Megatron numbers them ``ep_rank x num_local_experts + local index``)."""
    size = state.ep_size
    if size == 1:
        yield from zip(rule.hf_names(fields), full)
        return
    rank, group = state.ep_rank, state.ep_group
    num_local = model.config.num_moe_experts // size
    expert = int(fields["expert"])
    gathered = []
    for value in full:
        pieces = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(pieces, value.contiguous(), group=group)
        gathered.append(pieces)
    for peer in range(size):
        names = rule.hf_names({**fields, "expert": str(expert + (peer - rank) * num_local)})
        yield from zip(names, (pieces[peer] for pieces in gathered))


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """Where :func:`export_hf_shards` finds some of this rank's slices: ``getattr(module, attr)``,
    cut by ``rule.to_hf``; ``pieces`` are ``(index in to_hf's output, hf_name, shard)``."""

    module: torch.nn.Module
    attr: str
    rule: WeightRule
    pieces: tuple[tuple[int, str, int], ...]


def shard_sources(modules) -> list[ShardSource]:
    """The walk of :func:`export_hf_shards`, done once (name matching costs more than the slicing)."""
    sources = []
    for chunk in modules:
        model, state = unwrap(chunk), parallel_state_of(chunk)
        holders: dict[int, tuple[torch.nn.Module, str]] = {}
        for module in model.modules():
            for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None:
                    holders.setdefault(id(tensor), (module, attr))
        for _, tensor, rule, fields in mapped_tensors(model, model.hf_model_info.rules):
            if not rule.export:
                continue
            _, rank, size = shard_coordinates(rule, state)
            pieces = tuple(
                (k, hf_name, rank if dim is not None and size > 1 else 0)
                for k, (hf_name, dim) in enumerate(zip(rule.hf_names(fields), rule.tp_dims))
                if holds_shard(hf_name, rule.is_expert, dim, rank, size, state)
            )
            if pieces:
                sources.append(ShardSource(*holders[id(tensor)], rule, pieces))
    return sources


def export_hf_shards(modules=None, *, sources: list[ShardSource] | None = None) -> Iterator[tuple[str, int, torch.Tensor]]:
    """``(hf_name, shard, slice)`` for this rank's slice of every HF tensor it holds; no communication.

    The full tensor is the concatenation of slices ``0..size-1`` along the rule's TP dimension (what
    :func:`export_hf_weights` all-gathers); a tensor that is not split is yielded whole, as shard 0,
    by its owner only (:func:`holds_shard`). Slices may be views of the parameters. Pass ``sources``
    (:func:`shard_sources` of the same modules) to skip the walk; they read the current tensors.
    """
    for source in shard_sources(modules) if sources is None else sources:
        slices = source.rule.to_hf(getattr(source.module, source.attr).detach())
        for k, hf_name, shard in source.pieces:
            yield hf_name, shard, slices[k]


def save_hf(
    modules,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2**30,
    tokenizer_source: str | os.PathLike | None = None,
) -> None:
    """Writes an HF checkpoint of ``modules`` to ``path`` (collective: call on every rank).

    The directory gets ``*.safetensors`` files written by the owner ranks, ``model.safetensors.index.json``,
    ``config.json`` and the tokenizer files of ``tokenizer_source`` (default: the directory the model
    was loaded from), so ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it.

    Args:
        modules: this rank's chunks.
        path: output directory (on a file system every rank sees).
        dtype: tensor dtype on disk; default: the dtype the model was built with (``load_hf(dtype=)``).
        max_shard_bytes: a rank starts a new file after this many bytes; a rank's memory while saving
            is about twice this (safetensors serialises a file's tensors in memory).
        tokenizer_source: where to copy tokenizer files from.
    """
    info = unwrap(modules[0]).hf_model_info
    write_hf(export_hf_weights(modules), path, hf_config=info.hf_config, dtype=dtype or info.dtype,
             max_shard_bytes=max_shard_bytes, tokenizer_source=tokenizer_source or info.source)


def write_hf(
    tensors: Iterator[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    *,
    hf_config: dict,
    dtype: torch.dtype,
    max_shard_bytes: int = 2**30,
    tokenizer_source: str | os.PathLike | None = None,
) -> None:
    """Writes the HF tensors every rank yields as one HF checkpoint (collective: call on every rank).

    :func:`save_hf` with the tensors given: each rank writes what its ``tensors`` yield (each name on one
    rank only, e.g. :func:`export_hf_weights` with its default ``owner_only``, possibly transformed) into
    its own files; rank 0 then writes the index, ``hf_config`` as ``config.json`` and the tokenizer files
    of ``tokenizer_source``.
    """
    path = os.fspath(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        # Stale files of an earlier save would be listed nowhere but confuse readers of the directory.
        for name in os.listdir(path):
            if name.endswith(".safetensors") or name == INDEX_FILE:
                os.remove(os.path.join(path, name))
    _barrier()

    weight_map = _write_owned_tensors(tensors, path, rank, dtype, max_shard_bytes)
    maps = [None] * dist.get_world_size() if dist.is_initialized() else [weight_map]
    if dist.is_initialized():
        dist.all_gather_object(maps, weight_map)
    if rank == 0:
        _write_metadata(path, maps, hf_config, dtype, tokenizer_source)
    _barrier()


def _write_owned_tensors(tensors: Iterator[tuple[str, torch.Tensor]], path, rank, dtype,
                         max_shard_bytes) -> dict[str, tuple[str, int]]:
    from safetensors.torch import save_file

    weight_map: dict[str, tuple[str, int]] = {}
    buffer: dict[str, torch.Tensor] = {}
    buffered = 0
    part = 0

    def flush():
        nonlocal buffer, buffered, part
        if not buffer:
            return
        file = f"model-rank{rank:05d}-part{part:04d}.safetensors"
        save_file(buffer, os.path.join(path, file), metadata={"format": "pt"})
        for name, tensor in buffer.items():
            weight_map[name] = (file, tensor.numel() * tensor.element_size())
        buffer, buffered, part = {}, 0, part + 1

    for name, tensor in tensors:
        # A copy on the host: safetensors refuses tensors that share storage with each other.
        buffer[name] = tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        buffered += buffer[name].numel() * buffer[name].element_size()
        if buffered >= max_shard_bytes:
            flush()
    flush()
    return weight_map


def _write_metadata(path, maps, hf_config, dtype, tokenizer_source) -> None:
    weight_map, total = {}, 0
    for rank_map in maps:
        for name, (file, num_bytes) in rank_map.items():
            assert name not in weight_map, f"{name} was exported by two ranks ({weight_map[name]}, {file})"
            weight_map[name] = file
            total += num_bytes
    with open(os.path.join(path, INDEX_FILE), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, handle, indent=2)
    config = dict(hf_config)
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    source = resolve_checkpoint(tokenizer_source) if tokenizer_source is not None else None  # a GGUF: its conversion's files
    copied = []
    if source is not None and os.path.abspath(source) != os.path.abspath(path):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
                copied.append(name)
    logger.info("saved %d HF tensors (%.1f MB) to %s; copied %s", len(weight_map), total / 2**20, path, copied or "no tokenizer files")


def partial_output(out: str | os.PathLike) -> str:
    """Rank 0 empties ``<out>.partial`` for this attempt (collective); returns it.

    A command writes its output there and :func:`commit_output` renames it to ``<out>`` once every rank's
    files are on disk, so a run that dies leaves no ``<out>`` that looks finished.

    Raises:
        FileExistsError: ``out`` exists (nothing is overwritten).
    """
    out = os.fspath(out)
    if os.path.exists(out):
        raise FileExistsError(f"--out {out} exists; remove it or choose another directory (nothing was written)")
    partial = out.rstrip(os.sep) + ".partial"
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    return partial


def commit_output(partial: str, out: str | os.PathLike) -> None:
    """After every rank has written (collective): ``<out>.partial`` becomes ``<out>`` in one rename."""
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.rename(partial, os.fspath(out))
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
