"""How bucket bytes travel from the trainer to the rollout ranks (registry by name).

``distributed``
    A dedicated process group between the trainer ranks and the rollout ranks, built from its own
    TCP store (the trainer's torchrun world and the rollout processes need not share a default
    group). Each sending rank gets a group with just the rollout ranks, so a bucket part is one
    broadcast from its sender, the parts of a bucket travel at once, and ranks that send nothing take
    no part. Operations are asynchronous: a sender packs its part of bucket i+1 while bucket i is on
    the wire, a receiver posts bucket i+1 before unpacking i.
``colocated``
    The sender and the receiver are in one process: the receiver unpacks straight from the sender's
    bucket buffer; nothing is broadcast.
"""

from __future__ import annotations

import datetime
import logging
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.weight_sync.buckets import BucketSpec, PartSpec

logger = logging.getLogger(__name__)

TRANSPORTS: dict[str, type] = {}


def register_transport(name: str):
    def wrap(cls):
        TRANSPORTS[name] = cls
        return cls

    return wrap


def get_transport(name: str) -> type:
    if name not in TRANSPORTS:
        raise ValueError(f"weight_sync.transport={name!r} is not registered; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


class _Done:
    """A finished operation (the Work interface: ``wait``), holding the bytes' buffer."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def wait(self) -> bool:
        return True


class _Pending:
    """Asynchronous operations on one buffer (the parts of a bucket)."""

    def __init__(self, works, buffer: torch.Tensor):
        self.works = works
        self.buffer = buffer

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


@register_transport("distributed")
class TorchDistributedTransport:
    """A dedicated group: trainer ranks ``0..T-1`` (their trainer rank), rollout ranks ``T..T+R-1``.

    Args:
        address, port: the TCP store of this group (sync rank 0, the first trainer rank, hosts it).
        rank: this process's rank in the group.
        num_trainer_ranks: T; num_rollout_ranks: R.
        backend: of the bucket groups (the data); default: the platform's (gloo on the host, nccl on
            CUDA, hccl on Ascend). The handshake, barriers and verify log-probs always travel over gloo.
        timeout_s: for the store and every operation.
    """

    def __init__(self, *, address: str, port: int, rank: int, num_trainer_ranks: int, num_rollout_ranks: int,
                 backend: str | None = None, timeout_s: float = 600.0):
        if not 0 <= rank < num_trainer_ranks + num_rollout_ranks:
            raise ValueError(f"weight sync rank {rank} outside [0, {num_trainer_ranks + num_rollout_ranks})")
        self.rank = rank
        self.num_trainer_ranks = num_trainer_ranks
        self.rollout_ranks = list(range(num_trainer_ranks, num_trainer_ranks + num_rollout_ranks))
        self.backend = backend or platform.dist_backend()
        self.device = torch.device("cpu") if self.backend == "gloo" else platform.device()
        """Where bucket buffers and the receive arena live."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        size = num_trainer_ranks + num_rollout_ranks
        self._store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=self.timeout)
        self.world = platform.new_process_group("gloo", dist.PrefixStore("weight_sync/all", self._store), rank, size, self.timeout)
        self._owner_groups: dict[int, object] = {}

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    def connect(self, owners: list[int]) -> None:
        """Builds one group per sending rank (it and the rollout ranks); every member calls it."""
        for owner in owners:
            members = [owner, *self.rollout_ranks]
            if self.rank in members:
                store = dist.PrefixStore(f"weight_sync/owner{owner}", self._store)
                self._owner_groups[owner] = platform.new_process_group(self.backend, store, members.index(self.rank), len(members), self.timeout)

    def share_text(self, text: str | None, src: int = 0) -> str:
        """``text`` of rank ``src`` on every rank of the group (the plan handshake)."""
        length = torch.tensor([len(text.encode()) if self.rank == src else 0], dtype=torch.int64)
        self.world.broadcast(length, src).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))
        self.world.broadcast(data, src).wait()
        return bytes(data.numpy()).decode()

    def share_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.world.broadcast(tensor, src).wait()
        return tensor

    def group_of(self, owner: int):
        """The group of ``owner`` and the rollout ranks (owner is its rank 0)."""
        return self._owner_groups[owner]

    def barrier(self) -> None:
        self.world.broadcast(torch.zeros(1), 0).wait()

    def send(self, part: PartSpec, buffer: torch.Tensor):
        """Broadcasts this rank's ``part`` (packed at the start of ``buffer``) to the rollout ranks."""
        return _Pending([self._owner_groups[part.owner].broadcast(buffer[: part.buffer_bytes], 0)], buffer)

    def post(self, owner: int, tensors: list[torch.Tensor], buffer: torch.Tensor | None = None):
        """Direct transfer: broadcasts ``tensors`` (contiguous) from ``owner`` to the rollout ranks, in
        order (the receivers post tensors of the same sizes in the same order)."""
        group = self._owner_groups[owner]
        return _Pending([group.broadcast(tensor, 0) for tensor in tensors], buffer)

    def recv(self, bucket: BucketSpec, buffer: torch.Tensor):
        """Posts every part of ``bucket`` at once, each into its region of ``buffer``."""
        works = [self._owner_groups[part.owner].broadcast(part.region(buffer), 0) for part in bucket.parts]
        return _Pending(works, buffer)

    def close(self) -> None:
        self._owner_groups.clear()
        self.world = None
        self._store = None


@register_transport("colocated")
class ColocatedTransport:
    """Sender and receiver share a process: :meth:`recv` takes the sender's next packed bucket."""

    needs_buffers = False

    def __init__(self):
        self._stream: Iterator[tuple[BucketSpec, torch.Tensor]] | None = None

    def bind(self, stream: Iterator[tuple[BucketSpec, PartSpec | None, torch.Tensor]]) -> None:
        """``stream``: the colocated sender's :meth:`~megatron_gkd.weight_sync.WeightSender.packed`."""
        self._stream = stream

    def recv(self, bucket: BucketSpec, buffer: torch.Tensor | None = None):
        assert self._stream is not None, "bind the sender's stream first"
        sent, _, sent_buffer = next(self._stream)
        assert sent.index == bucket.index, (sent.index, bucket.index)
        return _Done(sent_buffer)

    def close(self) -> None:
        self._stream = None
