"""Small collectives on plain data (msgpack, never pickle) and failure agreement between ranks.

SPMD code fails on one rank at a time: a teacher error on the rank that talks to the teacher, a bad
config value read from a file on rank 0. If that rank raised alone, the others would wait in their
next collective forever. :func:`agree` turns a local outcome into the same outcome on every rank: all
continue, or all raise (the failing rank its own error, the others an error that names it).
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist


class PeerFailure(RuntimeError):
    """Another rank failed; this rank stops with it (the message names that rank and its error)."""


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def broadcast_msgpack(value: Any, src: int = 0, group=None) -> Any:
    """``value`` of global rank ``src`` (msgpack-able) on every rank of ``group``."""
    if _group_size(group) == 1:
        return value
    payload = msgpack.packb(value, use_bin_type=True) if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return msgpack.unpackb(data.numpy().tobytes(), raw=False)


def all_gather_msgpack(value: Any, group=None) -> list[Any]:
    """Every rank's ``value`` (msgpack-able), in group-rank order, on every rank of ``group``."""
    size = _group_size(group)
    if size == 1:
        return [value]
    payload = msgpack.packb(value, use_bin_type=True)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    longest = int(max(length.item() for length in lengths))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    return [msgpack.unpackb(data[: int(length.item())].numpy().tobytes(), raw=False)
            for data, length in zip(gathered, lengths)]


def agree(error: BaseException | None, group=None) -> None:
    """Collective: returns on every rank when no rank of ``group`` failed, else raises on every rank.

    Args:
        error: this rank's failure, or ``None``.
        group: the ranks that must agree (default: the world).

    Raises:
        the rank's own ``error`` on the ranks that failed; :class:`PeerFailure` naming the first failed
        rank and its message on the others.
    """
    if _group_size(group) == 1:
        if error is not None:
            raise error
        return
    failed = torch.tensor([1 if error is not None else 0], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    messages = all_gather_msgpack(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    first = next(i for i, message in enumerate(messages) if message is not None)
    raise PeerFailure(f"rank {ranks[first]} failed, so every rank stops: {messages[first]}")
