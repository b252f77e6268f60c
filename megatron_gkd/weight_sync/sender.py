"""Trainer side: gather shards into HF tensors, pack them into buckets, hand the buckets on."""

from __future__ import annotations

import logging
import time
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_gkd.models import export_hf_weights
from megatron_gkd.weight_sync.buckets import BucketSpec, allocate, layout_buckets, pack_stream
from megatron_gkd.weight_sync.config import WeightSyncConfig
from megatron_gkd.weight_sync.plan import WeightSyncPlan

logger = logging.getLogger(__name__)


class WeightSender:
    """Packs this rank's share of the plan into buckets, once per sync.

    Every trainer rank calls :meth:`sync` (or iterates :meth:`packed`) each time: the exporter's TP
    and expert-TP gathers are collectives even on ranks that own nothing.

    Args:
        plan: the plan of the whole trainer (:func:`~megatron_gkd.weight_sync.plan.build_plan`).
        transport: a transport instance (``send(bucket, buffer)`` returns a waitable), or ``None``
            for a colocated sender whose buckets are read by :meth:`packed`.
        config: bucket size, buffers, checksum.
        rank: this trainer rank (default: the default group's rank).
        owns_all: colocated layout: this rank packs every tensor of the plan (the exporter's
            all-gathers leave every tensor on every rank when PP = EP = 1).
    """

    def __init__(self, plan: WeightSyncPlan, transport, config: WeightSyncConfig, *, rank: int | None = None, owns_all: bool = False):
        self.plan = plan
        self.transport = transport
        self.config = config
        self.rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
        self.owns_all = owns_all
        self.buckets = [b for b in layout_buckets(plan, config.bucket_bytes) if owns_all or b.owner == self.rank]
        largest = max((b.buffer_bytes for b in self.buckets), default=0)
        self.buffers = [allocate(largest) for _ in range(config.num_buffers)] if largest else []
        self.last_sync_s = 0.0

    def _named_tensors(self, chunks):
        # A colocated rank needs every tensor; a disaggregated owner only the ones it sends.
        return export_hf_weights(chunks, owner_only=not self.owns_all)

    def packed(self, chunks, version: int, before_reuse=lambda slot: None) -> Iterator[tuple[BucketSpec, torch.Tensor]]:
        """``(bucket, buffer)`` for each of this rank's buckets; a buffer is rewritten after
        ``num_buffers`` more buckets (call ``before_reuse`` to wait on it)."""
        if not self.buckets:
            for _ in self._named_tensors(chunks):
                pass
            return
        named = self._named_tensors(chunks)
        for bucket, slot in pack_stream(named, self.buckets, self.buffers, version, self.config.checksum, before_reuse):
            yield bucket, self.buffers[slot]

    def sync(self, chunks, version: int) -> None:
        """Sends every bucket this rank owns over the transport (collective with the receivers)."""
        start = time.perf_counter()
        in_flight: dict[int, object] = {}

        def before_reuse(slot: int) -> None:
            if slot in in_flight:
                in_flight.pop(slot).wait()

        slot_of = {id(buffer): slot for slot, buffer in enumerate(self.buffers)}
        for bucket, buffer in self.packed(chunks, version, before_reuse):
            in_flight[slot_of[id(buffer)]] = self.transport.send(bucket, buffer)
        for work in in_flight.values():
            work.wait()
        if self.config.verify:
            self.share_student_logprobs(chunks)
        self.last_sync_s = time.perf_counter() - start
        logger.debug("rank %d sent %d buckets (version %d) in %.3f s", self.rank, len(self.buckets), version, self.last_sync_s)

    def share_student_logprobs(self, chunks) -> torch.Tensor | None:
        """``verify``: the student's log-probs on the verify prompts, broadcast to the receivers."""
        from megatron_gkd.weight_sync.verify import student_prompt_logprobs

        reference = student_prompt_logprobs(chunks, self.config.verify_prompts)
        if self.transport is not None and hasattr(self.transport, "share_tensor"):
            size = sum(len(p) - 1 for p in self.config.verify_prompts)
            buffer = reference if self.rank == self.plan.logits_rank else torch.empty(size, dtype=torch.float64)
            reference = self.transport.share_tensor(buffer.contiguous(), self.plan.logits_rank)
        return reference
