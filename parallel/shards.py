"""Gather and scatter tensor-parallel shards of a parameter.

A tensor-parallel parameter is split into ``size`` equal contiguous chunks along ``dim``; rank r holds
chunk r. Fused parameters that stack ``num_parts`` independently split matrices along ``dim`` (the
gated MLP's ``[gate; up]``: rank r holds ``[gate_r; up_r]``) pass ``num_parts``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_for_rank(full: torch.Tensor, dim: int, rank: int, size: int, *, num_parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a copy, contiguous).

    Raises:
        ValueError: the dimension does not split evenly.
    """
    if full.shape[dim] % (size * num_parts):
        raise ValueError(
            f"dimension {dim} of size {full.shape[dim]} does not split into {size} ranks x {num_parts} parts"
        )
    parts = full.chunk(num_parts, dim=dim)
    return torch.cat([part.chunk(size, dim=dim)[rank] for part in parts], dim=dim).contiguous()


def merge_shards(shards: list[torch.Tensor], dim: int, *, num_parts: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_for_rank`: the full tensor from every rank's shard, in rank order."""
    if num_parts == 1:
        return torch.cat(shards, dim=dim)
    split = [shard.chunk(num_parts, dim=dim) for shard in shards]
    return torch.cat([torch.cat([s[p] for s in split], dim=dim) for p in range(num_parts)], dim=dim)


def gather_tp(shard: torch.Tensor, dim: int, group: dist.ProcessGroup, *, num_parts: int = 1) -> torch.Tensor:
    """All-gathers the full tensor from this rank's shard over ``group`` (every rank gets it)."""
    size = dist.get_world_size(group)
    if size == 1:
        return shard.detach().clone()
    pieces = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(pieces, shard.detach().contiguous(), group=group)
    return merge_shards(pieces, dim, num_parts=num_parts)


def scatter_tp(full: torch.Tensor, dim: int, group: dist.ProcessGroup, *, num_parts: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor that every rank of ``group`` holds (no communication)."""
    return shard_for_rank(full, dim, dist.get_rank(group), dist.get_world_size(group), num_parts=num_parts)
