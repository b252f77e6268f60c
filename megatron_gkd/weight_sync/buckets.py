"""Fixed-size buckets: plan tensors packed into flat byte buffers, one part per sending rank.

:func:`layout_buckets` cuts the plan, in plan order, into buckets of at most ``bucket_bytes`` of
payload (a larger tensor travels alone). It is a pure function of the plan, so senders and receivers
agree on it without talking. Each tensor-parallel slice of a tensor comes from the rank that holds it,
so a bucket has one **part** per sending rank: every sender packs and sends only its own slices,
nobody all-gathers, and the receiver lays the parts side by side in one bucket buffer and concatenates
the slices of each tensor as it copies them out. (A colocated sync has no buckets:
:mod:`megatron_gkd.weight_sync.colocated`.)

A part is ``[payload | checksum int64 | version int64]``; parts start at 16-byte aligned offsets of
the bucket buffer and slices at 16-byte aligned offsets of their part, so every dtype can be viewed
in place. The checksum of a part is chosen by ``weight_sync.checksum`` (:mod:`megatron_gkd.weight_sync.checksums`).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable, Iterable, Iterator

import torch

from megatron_gkd.weight_sync.checksums import CHECKSUMS, as_bytes, fold_checksum  # noqa: F401 - re-exported
from megatron_gkd.weight_sync.errors import ChecksumMismatch
from megatron_gkd.weight_sync.plan import TensorSpec, WeightSyncPlan

ALIGN = 16
TRAILER_BYTES = 16


def _aligned(num_bytes: int) -> int:
    return (num_bytes + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class PartSpec:
    """One sender's share of a bucket: its slices packed back to back, then the trailer.

    ``slices[i] = (entry index in the bucket, shard index)`` lies at ``offsets[i]`` of the part; the
    part lies at ``start`` of the bucket buffer.
    """

    owner: int
    slices: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    payload_bytes: int
    start: int

    @property
    def buffer_bytes(self) -> int:
        return self.payload_bytes + TRAILER_BYTES

    def region(self, bucket_buffer: torch.Tensor) -> torch.Tensor:
        """This part's bytes inside a bucket buffer."""
        return bucket_buffer[self.start : self.start + self.buffer_bytes]


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """One bucket: the plan tensors it carries and the part of each sender."""

    index: int
    entries: tuple[TensorSpec, ...]
    parts: tuple[PartSpec, ...]
    tensor_offsets: tuple[int, ...] = ()
    """Direct transfer: where each whole tensor lies in the bucket's arena."""
    scratch_offsets: tuple[int | None, ...] = ()
    """Direct transfer: where the slices of a tensor split along a dimension other than 0 arrive
    (side by side, in a scratch buffer: they are concatenated into the arena); ``None`` for others."""

    @property
    def buffer_bytes(self) -> int:
        last = self.parts[-1]
        return last.start + last.buffer_bytes

    @property
    def payload_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self.entries)

    @property
    def arena_bytes(self) -> int:
        """Direct transfer: the arena holds the whole tensors, then a trailer per part."""
        return self.trailer_offset + TRAILER_BYTES * len(self.parts)

    @property
    def trailer_offset(self) -> int:
        return self.tensor_offsets[-1] + _aligned(self.entries[-1].num_bytes)

    @property
    def scratch_bytes(self) -> int:
        ends = [offset + _aligned(entry.num_bytes) for offset, entry in zip(self.scratch_offsets, self.entries) if offset is not None]
        return max(ends, default=0)

    def direct_slice(self, arena: torch.Tensor, scratch: torch.Tensor | None, entry_index: int, shard: int) -> torch.Tensor:
        """Direct transfer: where slice ``shard`` of entry ``entry_index`` arrives, shaped.

        The slices of a tensor that is not split or is split along dimension 0 arrive side by side in
        its place in the arena, which is then the tensor in HF layout; the others arrive in
        ``scratch`` (see :func:`unpack_arena`).
        """
        entry = self.entries[entry_index]
        num_bytes = _slice_bytes(entry)
        if self.scratch_offsets[entry_index] is None:
            buffer, start = arena, self.tensor_offsets[entry_index]
        else:
            buffer, start = scratch, self.scratch_offsets[entry_index]
        start += shard * num_bytes
        return buffer[start : start + num_bytes].view(entry.torch_dtype).view(self.slice_shape(entry))

    def arena_tensor(self, arena: torch.Tensor, entry_index: int) -> torch.Tensor:
        entry, start = self.entries[entry_index], self.tensor_offsets[entry_index]
        return arena[start : start + entry.num_bytes].view(entry.torch_dtype).view(entry.shape)

    def arena_trailer(self, arena: torch.Tensor, part_index: int) -> torch.Tensor:
        start = self.trailer_offset + TRAILER_BYTES * part_index
        return arena[start : start + TRAILER_BYTES].view(torch.int64)

    def part_of(self, owner: int) -> PartSpec | None:
        return next((part for part in self.parts if part.owner == owner), None)

    def slice_shape(self, entry: TensorSpec) -> tuple[int, ...]:
        return entry.shard_shape

    def slice_key(self, entry_index: int, shard: int) -> tuple[str, int]:
        return self.entries[entry_index].name, shard


def _slice_bytes(entry: TensorSpec) -> int:
    return entry.num_bytes // entry.num_shards


def _make_bucket(index: int, entries: list[TensorSpec]) -> BucketSpec:
    by_owner: dict[int, list[tuple[int, int]]] = {}
    for i, entry in enumerate(entries):
        for shard, owner in enumerate(entry.shards):
            by_owner.setdefault(owner, []).append((i, shard))
    parts, start = [], 0
    for owner in sorted(by_owner):
        offsets, offset = [], 0
        for i, _ in by_owner[owner]:
            offsets.append(offset)
            offset += _aligned(_slice_bytes(entries[i]))
        part = PartSpec(owner, tuple(by_owner[owner]), tuple(offsets), offset, start)
        parts.append(part)
        start += _aligned(part.buffer_bytes)
    tensor_offsets, scratch_offsets, offset, scratch = [], [], 0, 0
    for entry in entries:
        tensor_offsets.append(offset)
        offset += _aligned(entry.num_bytes)
        if entry.num_shards > 1 and entry.tp_dim != 0:
            scratch_offsets.append(scratch)
            scratch += _aligned(entry.num_bytes)
        else:
            scratch_offsets.append(None)
    return BucketSpec(index, tuple(entries), tuple(parts), tuple(tensor_offsets), tuple(scratch_offsets))


def layout_buckets(plan: WeightSyncPlan, bucket_bytes: int) -> list[BucketSpec]:
    """The plan's buckets in exchange order (plan order); each slice comes from the rank in its entry's ``shards``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if any(not entry.shards for entry in plan.entries):
        raise ValueError("this plan records no slice holders (built before sharded sync?); rebuild it with build_plan")
    buckets: list[BucketSpec] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for entry in plan.entries:
        size = _aligned(entry.num_bytes)
        if current and current_bytes + size > bucket_bytes:
            buckets.append(_make_bucket(len(buckets), current))
            current, current_bytes = [], 0
        current.append(entry)
        current_bytes += size
    if current:
        buckets.append(_make_bucket(len(buckets), current))
    return buckets


def part_context(bucket: BucketSpec, part: PartSpec, version: int) -> bytes:
    """The labels a keyed checksum binds to a part's bytes: no part can pass as another's or as another version."""
    return struct.pack("<qqq", version, bucket.index, part.owner)


def allocate(num_bytes: int, device=None) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


def pack(bucket: BucketSpec, part: PartSpec, tensors: dict[tuple[str, int], torch.Tensor], region: torch.Tensor, version: int,
         checksum: str, *, key: bytes | None = None) -> None:
    """Copies ``part``'s slices (``tensors[(name, shard)]``, shapes checked by :func:`complete_parts`)
    into ``region`` and writes the trailer."""
    for (i, shard), offset in zip(part.slices, part.offsets):
        entry = bucket.entries[i]
        shape = bucket.slice_shape(entry)
        tensor = tensors[entry.name, shard]
        num_bytes = _slice_bytes(entry)
        region[offset : offset + num_bytes].view(entry.torch_dtype).view(shape).copy_(tensor)
    trailer = region[part.payload_bytes : part.buffer_bytes].view(torch.int64)
    trailer[0] = fold_checksum(checksum, [region[: part.payload_bytes]], key=key, context=part_context(bucket, part, version))
    trailer[1] = version


def sent_version(bucket: BucketSpec, buffer: torch.Tensor) -> int:
    """The weight version written in the first part of a received bucket."""
    part = bucket.parts[0]
    return int(part.region(buffer)[part.payload_bytes :].view(torch.int64)[1])


def _check_part(bucket: BucketSpec, part: PartSpec, got: int, sent_sum: int, sent: int, version: int | None) -> None:
    if got != sent_sum:
        first = bucket.entries[part.slices[0][0]].name
        raise ChecksumMismatch(
            f"bucket {bucket.index}, part of rank {part.owner} ({len(part.slices)} slices, first {first}): "
            f"checksum {got} != sent {sent_sum}"
        )
    if version is not None and sent != version:
        raise ChecksumMismatch(f"bucket {bucket.index}, part of rank {part.owner} carries version {sent}, expected {version}")


def unpack(bucket: BucketSpec, buffer: torch.Tensor, checksum: str, version: int | None = None, *,
           key: bytes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Verifies every part's trailer and yields ``(name, full tensor)`` in bucket order: new tensors
    (the slices concatenated along ``tp_dim``, or a copy), never views into ``buffer``.

    Raises:
        ChecksumMismatch: wrong checksum, or a version other than ``version``.
    """
    views: dict[tuple[int, int], torch.Tensor] = {}
    for part in bucket.parts:
        region = part.region(buffer)
        sent_sum, sent = region[part.payload_bytes :].view(torch.int64).tolist()
        got = fold_checksum(checksum, [region[: part.payload_bytes]], key=key, context=part_context(bucket, part, sent))
        _check_part(bucket, part, got, sent_sum, sent, version)
        for (i, shard), offset in zip(part.slices, part.offsets):
            entry = bucket.entries[i]
            num_bytes = _slice_bytes(entry)
            views[i, shard] = region[offset : offset + num_bytes].view(entry.torch_dtype).view(bucket.slice_shape(entry))
    for i, entry in enumerate(bucket.entries):
        count = entry.num_shards
        if count == 1:
            yield entry.name, views[i, 0].clone()
        else:
            yield entry.name, torch.cat([views[i, shard] for shard in range(count)], dim=entry.tp_dim)


@dataclasses.dataclass
class ArenaViews:
    """Direct transfer: the views of one bucket's arena and scratch, made once and used every sync.

    ``parts[p]`` are the slices of part ``p`` where they arrive, in part order, ``trailers[p]`` its
    ``[checksum, version]``; ``tensors`` the whole tensors in the arena; ``concat`` the
    ``(tensor, slices, dim)`` to concatenate from scratch.
    """

    parts: list[list[torch.Tensor]]
    trailers: list[torch.Tensor]
    tensors: list[torch.Tensor]
    concat: list[tuple[torch.Tensor, list[torch.Tensor], int]]


def arena_views(bucket: BucketSpec, arena: torch.Tensor, scratch: torch.Tensor | None) -> ArenaViews:
    tensors = [bucket.arena_tensor(arena, i) for i in range(len(bucket.entries))]
    concat = [
        (tensors[i], [bucket.direct_slice(arena, scratch, i, shard) for shard in range(entry.num_shards)], entry.tp_dim)
        for i, entry in enumerate(bucket.entries)
        if bucket.scratch_offsets[i] is not None
    ]
    return ArenaViews(
        parts=[[bucket.direct_slice(arena, scratch, i, shard) for i, shard in part.slices] for part in bucket.parts],
        trailers=[bucket.arena_trailer(arena, p) for p in range(len(bucket.parts))],
        tensors=tensors,
        concat=concat,
    )


def unpack_arena(bucket: BucketSpec, views: ArenaViews, checksum: str, version: int | None = None, *,
                 key: bytes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Direct transfer: verifies every part's trailer and yields ``(name, full tensor)`` in bucket
    order, each a view of the arena: in place already for a tensor that is not split or is split along
    dimension 0, else its slices concatenated from scratch into its place. The arena must not be
    rewritten while the views are used; scratch may be reused once this generator has finished.

    Raises:
        ChecksumMismatch: wrong checksum, or a version other than ``version``.
    """
    for part, slices, trailer in zip(bucket.parts, views.parts, views.trailers):
        sent_sum, sent = trailer.tolist()
        got = fold_checksum(checksum, slices, key=key, context=part_context(bucket, part, sent))
        _check_part(bucket, part, got, sent_sum, sent, version)
    for tensor, slices, dim in views.concat:
        torch.cat(slices, dim=dim, out=tensor)
    for entry, tensor in zip(bucket.entries, views.tensors):
        yield entry.name, tensor


def complete_parts(
    slices: Iterable[tuple[str, int, torch.Tensor]],
    work: list[tuple[BucketSpec, PartSpec]],
) -> Iterator[tuple[BucketSpec, PartSpec, dict[tuple[str, int], torch.Tensor]]]:
    """Follows the exporter's ``(name, shard, tensor)`` stream through this rank's parts (exchange
    order): yields ``(bucket, part, slices)`` as soon as every slice of ``part`` has arrived, then
    forgets those slices.

    Raises:
        RuntimeError: the stream ended before every part was complete, or carried unplanned slices.
    """
    pending: dict[tuple[str, int], torch.Tensor] = {}
    # Each part with the slice keys it waits for, listed once (not on every arriving slice).
    remaining = iter([(bucket, part, [bucket.slice_key(i, shard) for i, shard in part.slices]) for bucket, part in work])
    current = next(remaining, None)

    for name, shard, tensor in slices:
        pending[name, shard] = tensor
        while current is not None and all(key in pending for key in current[2]):
            bucket, part, keys = current
            ready = {key: pending.pop(key) for key in keys}
            for (i, shard_index), key in zip(part.slices, keys):
                got, shape = tuple(ready[key].shape), bucket.slice_shape(bucket.entries[i])
                assert got == shape, (bucket.entries[i].name, shard_index, got, shape)
            yield bucket, part, ready
            current = next(remaining, None)
    if current is not None or pending:
        missing = [] if current is None else [key for key in current[2] if key not in pending]
        raise RuntimeError(
            f"exporter stream ended before bucket {current and current[0].index} was complete (missing {missing[:5]}); "
            f"unplanned slices {sorted(pending)[:5]}"
        )


def pack_stream(
    slices: Iterable[tuple[str, int, torch.Tensor]],
    work: list[tuple[BucketSpec, PartSpec]],
    buffers: list[torch.Tensor],
    version: int,
    checksum: str,
    before_reuse: Callable[[int], None],
    *,
    key: bytes | None = None,
) -> Iterator[tuple[BucketSpec, PartSpec, int]]:
    """Packs this rank's parts (exchange order) from the exporter's ``(name, shard, tensor)`` stream.

    Yields ``(bucket, part, slot)`` once ``buffers[slot]`` holds the part (at offset 0); slots rotate,
    and ``before_reuse(slot)`` is called before a slot is written again (wait for its send there).
    """
    for count, (bucket, part, ready) in enumerate(complete_parts(slices, work)):
        slot = count % len(buffers)
        before_reuse(slot)
        pack(bucket, part, ready, buffers[slot][: part.buffer_bytes], version, checksum, key=key)
        yield bucket, part, slot
