"""Trainer side: each rank packs the slices it holds into its parts of the buckets and sends them."""

from __future__ import annotations

import collections
import logging
import time

import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.models import export_hf_shards, shard_sources
from megatron_gkd.weight_sync.buckets import (
    BucketSpec,
    PartSpec,
    allocate,
    complete_parts,
    fold_checksum,
    layout_buckets,
    pack_stream,
    part_context,
)
from megatron_gkd.weight_sync.config import WeightSyncConfig, warn_if_unauthenticated
from megatron_gkd.weight_sync.errors import WeightSyncError
from megatron_gkd.weight_sync.plan import WeightSyncPlan
from megatron_gkd.weight_sync.verify import student_prompt_logprobs

logger = logging.getLogger(__name__)


class WeightSender:
    """Packs this rank's share of the plan into bucket parts, once per sync.

    Distributed layout: every rank of the first data-parallel replica sends the tensor-parallel slices
    it holds (its parts of the buckets); there are no gathers, so ranks proceed independently and a
    rank that holds nothing returns at once. (A colocated sync sends nothing:
    :func:`~megatron_gkd.weight_sync.colocated.colocated_sync`.)

    Args:
        plan: the plan of the whole trainer (:func:`~megatron_gkd.weight_sync.plan.build_plan`).
        transport: a transport instance (``send(part, buffer)`` returns a waitable).
        config: bucket size, buffers, checksum.
        rank: this trainer rank (default: the default group's rank).
    """

    def __init__(self, plan: WeightSyncPlan, transport, config: WeightSyncConfig, *, rank: int | None = None):
        self.plan = plan
        self.transport = transport
        self.config = config
        self.rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
        buckets = layout_buckets(plan, config.bucket_bytes)
        self.work: list[tuple[BucketSpec, PartSpec]] = [
            (bucket, part) for bucket in buckets for part in bucket.parts if part.owner == self.rank
        ]
        self.transfer = config.resolved_transfer(transport)
        sizes = [part.buffer_bytes for _, part in self.work]
        packs = sizes and self.transfer == "packed"
        device = getattr(transport, "device", None) or platform.device()
        self.buffers = [allocate(max(sizes), device) for _ in range(config.num_buffers)] if packs else []
        self.key = getattr(transport, "bucket_key", None)
        warn_if_unauthenticated(config, self.key)
        self.last_sync_s = 0.0
        self._sources: tuple[tuple[int, ...], list] | None = None

    def _shards(self, chunks):
        key = tuple(id(chunk) for chunk in chunks)
        if self._sources is None or self._sources[0] != key:
            self._sources = (key, shard_sources(chunks))
        return export_hf_shards(sources=self._sources[1])

    def sync(self, chunks, version: int, *, check: bool = False) -> None:
        """Sends every part this rank holds over the transport (collective: every trainer rank and
        every rollout rank of the transport take part, including ranks that send nothing); with ``config.verify``
        or ``check`` (the receivers verify this sync as the periodic engine check) the student's log-probs on the
        verify prompts follow.

        Raises:
            WeightSyncError: a rollout rank did not take ``version`` (its engine refuses to generate
                until a sync succeeds; the sync may be retried), or, as
                :class:`~megatron_gkd.weight_sync.errors.WeightSyncTransportError`, the transport
                failed (a rank died or hung past ``timeout_s``; build a new transport).
        """
        start = time.perf_counter()
        self.transport.begin(version)
        if self.transfer == "direct":
            self._send_direct(chunks, version)
        else:
            self._send_packed(chunks, version)
        if not self.transport.agree(True):
            raise WeightSyncError(
                f"weight version {version} did not reach every rollout rank: a rollout rank refused or failed to "
                "load it (its log says why) and its engine refuses to generate until a sync succeeds; retry the sync")
        if self.config.verify or check:
            self.share_student_logprobs(chunks)
        self.last_sync_s = time.perf_counter() - start
        logger.debug("rank %d sent %d bucket parts (version %d, %s) in %.3f s", self.rank, len(self.work), version,
                     self.transfer, self.last_sync_s)

    def _send_direct(self, chunks, version: int) -> None:
        """Each slice broadcast from where it lies (a copy only for a strided slice), then the part's
        trailer, summed while the slices are on the wire; at most ``num_buffers`` buckets in flight,
        and all done before returning, so the parameters may change afterwards."""
        in_flight: collections.deque = collections.deque()
        for bucket, part, ready in complete_parts(self._shards(chunks), self.work):
            tensors = [ready[bucket.slice_key(i, shard)].contiguous() for i, shard in part.slices]
            if len(in_flight) >= self.config.num_buffers:
                for work in in_flight.popleft():
                    work.wait()
            slices = self.transport.post(part.owner, tensors)
            value = fold_checksum(self.config.checksum, tensors, key=self.key, context=part_context(bucket, part, version))
            trailer = torch.tensor([value, version], dtype=torch.int64, device=tensors[0].device)
            in_flight.append((slices, self.transport.post(part.owner, [trailer])))
        for works in in_flight:
            for work in works:
                work.wait()

    def _send_packed(self, chunks, version: int) -> None:
        """Each part packed into the next buffer and sent; a buffer is rewritten only once its send is done."""
        if not self.work:
            return
        in_flight: dict[int, object] = {}

        def before_reuse(slot: int) -> None:
            if slot in in_flight:
                in_flight.pop(slot).wait()

        stream = pack_stream(self._shards(chunks), self.work, self.buffers, version, self.config.checksum, before_reuse,
                             key=self.key)
        for _, part, slot in stream:
            in_flight[slot] = self.transport.send(part, self.buffers[slot])
        for work in in_flight.values():
            work.wait()

    def share_student_logprobs(self, chunks) -> torch.Tensor | None:
        """``verify``: the student's log-probs on the verify prompts, broadcast to the receivers."""
        reference = student_prompt_logprobs(chunks, self.config.verify_prompts)
        if hasattr(self.transport, "share_tensor"):
            size = sum(len(p) - 1 for p in self.config.verify_prompts)
            buffer = reference if self.rank == self.plan.logits_rank else torch.empty(size, dtype=torch.float64)
            reference = self.transport.share_tensor(buffer.contiguous(), self.plan.logits_rank)
        return reference
