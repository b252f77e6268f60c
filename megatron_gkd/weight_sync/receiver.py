"""Rollout side: receive buckets, copy the tensors out, load them into vLLM in place."""

from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator

import torch

from megatron_gkd.weight_sync.buckets import BucketSpec, ChecksumMismatch, allocate, layout_buckets, arena_views, sent_version, unpack, unpack_arena
from megatron_gkd.weight_sync.config import WeightSyncConfig
from megatron_gkd.weight_sync.plan import WeightSyncPlan
from megatron_gkd.weight_sync.verify import check_prompt_logprobs, vllm_prompt_logprobs

logger = logging.getLogger(__name__)


def reload_vllm_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Loads ``(hf_name, tensor)`` pairs into ``llm`` through vLLM's in-place reload.

    ``worker.model_runner.reload_weights`` reruns the backend's post-load processing, which writing
    ``param.data`` or calling ``load_weights`` after start-up does not (see ENVIRONMENT.md). The
    pairs are consumed lazily, so a receiver can stream buckets into it. One worker per process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` or ``external_launcher``): the iterator is consumed once.
    """
    weights = iter(named_tensors)

    def reload(worker):
        worker.model_runner.reload_weights(weights_iterator=weights)
        _repack_cpu_moe_experts(worker.model_runner.get_model())

    llm.collective_rpc(reload)


def _repack_cpu_moe_experts(model) -> int:
    """Redoes the CPU backend's expert prepacking that vLLM 0.32 skips on an in-place reload.

    ``UnquantizedFusedMoEMethod._setup_kernel`` calls ``fused_experts.process_weights_after_loading``
    (the CPU grouped-GEMM prepack) only on the first load; on a weight update it copies the freshly
    loaded, *unpacked* experts into the packed storage, and the engine then computes garbage (seen
    here: reloading a Qwen3-MoE checkpoint's own weights moved prompt log-probs by 0.19). Repacking
    after the reload gives transformers' log-probs within 4e-7. Only on the CPU platform, where that
    method turns loaded weights into the kernel layout.
    """
    layers = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            layers.append((module, experts))
    if not layers:
        return 0
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    for module, experts in layers:
        experts.process_weights_after_loading(module)
    return len(layers)


class WeightReceiver:
    """Receives every bucket of the plan in exchange order and streams the tensors into vLLM.

    Args:
        plan: the trainer's plan (from the handshake).
        transport: ``recv(bucket, buffer)`` returns a waitable with the bucket's bytes in ``.buffer``
            (every sender's part at its ``start``).
        config: bucket size, buffers, checksum, verify.
    """

    def __init__(self, plan: WeightSyncPlan, transport, config: WeightSyncConfig):
        self.plan = plan
        self.transport = transport
        self.config = config
        # A colocated transport hands over the sender's own buffers, packed from whole tensors.
        needs_buffers = getattr(transport, "needs_buffers", True)
        self.buckets: list[BucketSpec] = layout_buckets(plan, config.bucket_bytes, sharded=needs_buffers)
        self.transfer = config.resolved_transfer(transport)
        device = getattr(transport, "device", None)
        if self.transfer == "direct":
            # One arena region per bucket, allocated once: never rewritten while vLLM reads it.
            starts = [0]
            for bucket in self.buckets:
                starts.append(starts[-1] + (bucket.arena_bytes + 15) // 16 * 16)
            arena = allocate(starts[-1], device)
            self.buffers = [arena[start : start + bucket.arena_bytes] for start, bucket in zip(starts, self.buckets)]
            # Slices to concatenate arrive in scratch buffers, one per bucket in flight plus the one
            # unpacked: _receive_direct must never post more than num_buffers buckets ahead (posting
            # every bucket at once overwrote a scratch buffer still being received; the checksum caught it).
            largest = max(bucket.scratch_bytes for bucket in self.buckets)
            slots = min(max(config.num_buffers, 1) + 1, len(self.buckets))
            scratch = [allocate(largest, device) if largest else None for _ in range(slots)]
            self._views = [arena_views(bucket, self.buffers[i], scratch[i % len(scratch)]) for i, bucket in enumerate(self.buckets)]
            self.buffer_bytes = arena.numel() + sum(buffer.numel() for buffer in scratch if buffer is not None)
        else:
            largest = max(b.buffer_bytes for b in self.buckets)
            self.buffers = [allocate(largest, device) for _ in range(config.num_buffers)] if needs_buffers else [None]
            self.buffer_bytes = sum(buffer.numel() for buffer in self.buffers if buffer is not None)
        # self.buffer_bytes: the host or device memory this receiver keeps between syncs.
        logger.info("weight receiver: %d buckets, %s transfer, %.1f MiB of buffers", len(self.buckets), self.transfer, self.buffer_bytes / 2**20)
        self.version = 0
        self.last_sync_s = 0.0

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every plan tensor, bucket by bucket.

        Packed: new tensors copied out of the bucket buffers; with two or more buffers, bucket i+1 is
        posted before bucket i is unpacked (and loaded by the consumer of this iterator), so the wire
        and the copies overlap. Direct: views of the receive arena (valid until the next sync), and
        ``num_buffers`` buckets posted ahead.
        """
        if self.transfer == "direct":
            yield from self._receive_direct()
            return
        incoming = None
        buffers = self.buffers
        prefetch = len(buffers) > 1
        pending = self.transport.recv(self.buckets[0], buffers[0])
        for i, bucket in enumerate(self.buckets):
            pending.wait()
            current = pending
            last = i + 1 == len(self.buckets)
            if prefetch and not last:
                pending = self.transport.recv(self.buckets[i + 1], buffers[(i + 1) % len(buffers)])
            if incoming is None:
                incoming = self._newer(sent_version(bucket, current.buffer))
            yield from unpack(bucket, current.buffer, self.config.checksum, version=incoming)
            if not prefetch and not last:
                pending = self.transport.recv(self.buckets[i + 1], buffers[0])
        self._incoming = incoming

    def _newer(self, incoming: int) -> int:
        if incoming <= self.version:
            raise ChecksumMismatch(f"received weight version {incoming}, not newer than {self.version}")
        return incoming

    def _receive_direct(self) -> Iterator[tuple[str, torch.Tensor]]:
        def post(index: int) -> list:
            views = self._views[index]
            return [self.transport.post(part.owner, [*slices, trailer])
                    for part, slices, trailer in zip(self.buckets[index].parts, views.parts, views.trailers)]

        ahead = max(self.config.num_buffers, 1)
        posted = [post(index) for index in range(min(ahead, len(self.buckets)))]
        incoming = None
        for index, bucket in enumerate(self.buckets):
            for work in posted[index]:
                work.wait()
            posted[index] = None
            if index + ahead < len(self.buckets):
                posted.append(post(index + ahead))
            views = self._views[index]
            if incoming is None:
                incoming = self._newer(int(views.trailers[0][1]))
            yield from unpack_arena(bucket, views, self.config.checksum, version=incoming)
        self._incoming = incoming

    def sync(self, llm, expected_logprobs: torch.Tensor | None = None, *, verify: bool | None = None) -> int:
        """Receives one full set of weights into ``llm``; returns the new weight version.

        With ``config.verify``, ``expected_logprobs`` (the student's, on ``config.verify_prompts``)
        must be given or arrive over the transport (``share_tensor`` from the plan's logits rank).

        Raises:
            ChecksumMismatch: a bucket arrived corrupted or from another version.
            WeightSyncMismatch: ``verify`` found vLLM computing something else than the student.
        """
        start = time.perf_counter()
        reload_vllm_weights(llm, self.receive())
        self.version = self._incoming
        self.last_sync_s = time.perf_counter() - start
        logger.info("weights version %d loaded in %.3f s", self.version, self.last_sync_s)
        if self.config.verify if verify is None else verify:
            if expected_logprobs is None:
                size = sum(len(p) - 1 for p in self.config.verify_prompts)
                expected_logprobs = self.transport.share_tensor(torch.empty(size, dtype=torch.float64), self.plan.logits_rank)
            self.verify(llm, expected_logprobs)
        return self.version

    def verify(self, llm, expected_logprobs: torch.Tensor) -> float:
        """Raises :class:`~megatron_gkd.weight_sync.verify.WeightSyncMismatch` unless vLLM matches."""
        got = vllm_prompt_logprobs(llm, self.config.verify_prompts)
        error = check_prompt_logprobs(got, expected_logprobs, self.config.verify_tolerance, self.version)
        logger.info("verified version %d: max |log-prob error| %.2e", self.version, error)
        return error
