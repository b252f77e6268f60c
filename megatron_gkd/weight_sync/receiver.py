"""Rollout side: receive buckets, copy the tensors out, load them into vLLM in place.

Fail closed: the engine is marked stale while it loads (see
:class:`~megatron_gkd.rollout.engine.RolloutEngine`), so a sync that fails part-way (a corrupted
bucket, a sender that died or hangs past the transport's ``timeout_s``, a reload error) leaves it
refusing to generate until a sync succeeds. After a failure that left the transport usable, the rest
of the buckets are still received (and dropped), so the senders finish and the next sync starts in
step; every rank learns the outcome (``transport.agree``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable, Iterator

import torch

from megatron_gkd.weight_sync.buckets import BucketSpec, allocate, arena_views, layout_buckets, sent_version, unpack, unpack_arena
from megatron_gkd.weight_sync.config import WeightSyncConfig, warn_if_unauthenticated
from megatron_gkd.weight_sync.errors import ChecksumMismatch, WeightSyncError, WeightSyncTransportError
from megatron_gkd.weight_sync.plan import WeightSyncPlan
from megatron_gkd.weight_sync.reload_logs import audit_reload, reprocess_tied_layers
from megatron_gkd.weight_sync.verify import check_prompt_logprobs, verification

logger = logging.getLogger(__name__)


def reload_vllm_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Loads ``(hf_name, tensor)`` pairs, every weight of the model, into ``llm`` through vLLM's in-place reload.

    ``worker.model_runner.reload_weights`` reruns the backend's post-load processing, which writing
    ``param.data`` or calling ``load_weights`` after start-up does not (seen on vLLM 0.32's CPU backend, which
    keeps its own processed copy of the weights: a write to ``param.data`` did not change generation, and a
    second ``load_weights`` failed on the emptied parameters). The pairs are consumed lazily, so a receiver can stream
    buckets into it. One worker per process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` or ``external_launcher``): the iterator is consumed once.

    Raises:
        WeightSyncError: the reload left a layer or a weight out (vLLM only warns, and keeps the old tensors there:
            :mod:`~megatron_gkd.weight_sync.reload_logs`); the engine then mixes two versions.
    """
    weights = iter(named_tensors)

    def reload(worker):
        model = worker.model_runner.get_model()
        audit = audit_reload(model)
        worker.model_runner.reload_weights(weights_iterator=weights)
        reprocess_tied_layers(model)  # a tied head's processed copy of the embedding (vLLM skips it)
        _repack_cpu_moe_experts(model)
        return audit.problems()

    problems = [found for found in llm.collective_rpc(reload) if found]
    if problems:
        raise WeightSyncError(f"vLLM's reload left weights out, so the engine mixes old and new weights: {problems[0]}")


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
        self.buckets: list[BucketSpec] = layout_buckets(plan, config.bucket_bytes)
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
            self.buffers = [allocate(largest, device) for _ in range(config.num_buffers)]
            self.buffer_bytes = sum(buffer.numel() for buffer in self.buffers)
        # self.buffer_bytes: the host or device memory this receiver keeps between syncs.
        logger.info("weight receiver: %d buckets, %s transfer, %.1f MiB of buffers", len(self.buckets), self.transfer,
                    self.buffer_bytes / 2**20)
        self.key = getattr(transport, "bucket_key", None)
        warn_if_unauthenticated(config, self.key)
        self.version = 0
        self.last_sync_s = 0.0

    def receive(self, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every plan tensor, bucket by bucket (without the sync's framing).

        Packed: new tensors copied out of the bucket buffers; with two or more buffers, bucket i+1 is
        posted before bucket i is unpacked (and loaded by the consumer of this iterator), so the wire
        and the copies overlap. Direct: views of the receive arena (valid until the next sync), and
        ``num_buffers`` buckets posted ahead. ``version``: the one every part must carry (default:
        that of the first bucket, which must be newer than the last received).
        """
        return _Reception(self, version).tensors()

    def sync(self, engine, expected_logprobs: torch.Tensor | None = None, *, verify: bool | None = None,
             expect_version: int | None = None, check: float | None = None) -> int:
        """Receives one full set of weights into ``engine`` (a rollout engine); returns the new version.

        The version comes from trainer rank 0 (``transport.begin``): it must be newer than the last,
        equal ``expect_version`` when given, and every bucket part must carry it. The tensors stream
        into ``engine.load_weights`` bucket by bucket. With ``config.verify``, ``expected_logprobs``
        (the student's, on ``config.verify_prompts``) must be given or arrive over the transport
        (``share_tensor`` from the plan's logits rank); ``check`` (a tolerance in nats): verify this sync as the
        periodic engine check (the mean error; :func:`~megatron_gkd.weight_sync.verify.verification`).

        Raises:
            ChecksumMismatch: a bucket arrived corrupted, from an old version or not the expected one
                (the engine is stale if anything was loaded; the other buckets were still received).
            WeightSyncTransportError: the transport failed (e.g. a sender died or hung past
                ``timeout_s``); the engine is stale and the transport unusable.
            WeightSyncError: the engine failed to load the weights, or another rollout rank failed.
            WeightSyncMismatch: ``verify`` found the engine computing something else than the student
                (the engine is marked stale).
        """
        start = time.perf_counter()
        version = self.transport.begin(None)
        if version is None:  # a transport without framing: every part must carry the expected version
            version = expect_version
        reception = _Reception(self, version)
        failure = None
        try:
            if version is not None and version <= self.version:
                raise ChecksumMismatch(f"received weight version {version}, not newer than {self.version}")
            if expect_version is not None and version != expect_version:
                raise ChecksumMismatch(f"received weight version {version}, expected {expect_version}")
            engine.load_weights(reception.tensors(), version=version)
            reception.drain()  # buckets an engine left unread (none for the engines here)
        except WeightSyncTransportError as error:
            logger.error("weight version %s did not arrive (%s); the engine refuses to generate until a sync "
                         "succeeds", version, error)
            raise WeightSyncTransportError(f"weight version {version} did not arrive: {error}") from error
        except Exception as error:  # noqa: BLE001 - any failure fails this sync on every rank, below
            failure = error
            logger.error("weight version %s was not loaded (%s: %s); the engine refuses to generate until a "
                         "sync succeeds", version, type(error).__name__, error)
            reception.drain()
        everyone = self.transport.agree(failure is None)
        if failure is not None:
            if isinstance(failure, WeightSyncError):
                raise failure
            raise WeightSyncError(f"weight version {version} was not loaded: {type(failure).__name__}: {failure}") from failure
        self.version = reception.version
        self.last_sync_s = time.perf_counter() - start
        if not everyone:
            raise WeightSyncError(f"weight version {self.version} reached this rollout rank but not every other one; "
                                  "the trainers will retry")
        logger.debug("weights version %d loaded in %.3f s", self.version, self.last_sync_s)  # time/weight_sync
        config = self.config if verify is None else dataclasses.replace(self.config, verify=verify)
        if verification(config, check) is not None:
            if expected_logprobs is None:
                size = sum(len(p) - 1 for p in self.config.verify_prompts)
                expected_logprobs = self.transport.share_tensor(torch.empty(size, dtype=torch.float64), self.plan.logits_rank)
            try:
                self.verify(engine, expected_logprobs, *verification(config, check))
            except WeightSyncError as error:
                engine.mark_stale(str(error))
                raise
        return self.version

    def verify(self, engine, expected_logprobs: torch.Tensor, tolerance: float | None = None, mean: bool = False) -> float:
        """Raises :class:`~megatron_gkd.weight_sync.verify.WeightSyncMismatch` unless the engine matches (within
        ``tolerance``, default ``verify_tolerance``, at the worst token or on average with ``mean``)."""
        got = engine.prompt_logprobs(self.config.verify_prompts)
        tolerance = self.config.verify_tolerance if tolerance is None else tolerance
        error = check_prompt_logprobs(got, expected_logprobs, tolerance, self.version, mean=mean)
        logger.debug("verified version %d: max |log-prob error| %.2e", self.version, error)  # every sync
        return error


class _Reception:
    """One sync's buckets, in exchange order; :meth:`drain` receives the rest after a failure.

    ``posted`` holds the buckets whose receive is on the wire; ``next_post`` is the first one not
    posted yet. Waiting goes through the transport's operations, which raise
    :class:`WeightSyncTransportError` on a timeout or a broken connection.
    """

    def __init__(self, receiver: WeightReceiver, version: int | None):
        self.receiver, self.version = receiver, version
        self.buckets = receiver.buckets
        self.posted: dict[int, object] = {}
        self.next_post = 0

    def _post(self, index: int) -> None:
        transport = self.receiver.transport
        if self.receiver.transfer == "direct":
            views = self.receiver._views[index]
            works = [transport.post(part.owner, [*slices, trailer])
                     for part, slices, trailer in zip(self.buckets[index].parts, views.parts, views.trailers)]
        else:
            buffers = self.receiver.buffers
            works = [transport.recv(self.buckets[index], buffers[index % len(buffers)])]
        self.posted[index] = works
        self.next_post = index + 1

    def _wait(self, index: int) -> object:
        works = self.posted.pop(index)
        for work in works:
            work.wait()
        return works[-1]

    def _first_version(self, index: int, done) -> int:
        # Without the sync's framing (receive() alone) the version is that of the first bucket.
        bucket = self.buckets[index]
        if self.receiver.transfer == "direct":
            incoming = int(self.receiver._views[index].trailers[0][1])
        else:
            incoming = sent_version(bucket, done.buffer)
        if incoming <= self.receiver.version:
            raise ChecksumMismatch(f"received weight version {incoming}, not newer than {self.receiver.version}")
        return incoming

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        config, key = self.receiver.config, self.receiver.key
        direct = self.receiver.transfer == "direct"
        # Direct: num_buffers buckets in flight (their scratch must not be reused before they are
        # unpacked). Packed: one ahead when there is a second buffer, so wire and copies overlap.
        ahead = max(config.num_buffers, 1) if direct else min(len(self.receiver.buffers) - 1, 1)
        for index in range(min(max(ahead, 1), len(self.buckets))):
            self._post(index)
        for index, bucket in enumerate(self.buckets):
            if self.next_post == index:  # one buffer: reused once the previous bucket is unpacked
                self._post(index)
            done = self._wait(index)
            while self.next_post < min(index + 1 + ahead, len(self.buckets)):
                self._post(self.next_post)
            if self.version is None:
                self.version = self._first_version(index, done)
            if direct:
                yield from unpack_arena(bucket, self.receiver._views[index], config.checksum, version=self.version, key=key)
            else:
                yield from unpack(bucket, done.buffer, config.checksum, version=self.version, key=key)

    def drain(self) -> None:
        """Receives (and drops) every bucket not received yet, one at a time."""
        for index in sorted(self.posted):
            self._wait(index)
        while self.next_post < len(self.buckets):
            index = self.next_post
            self._post(index)
            self._wait(index)
