"""Colocated weight sync: the trainer rank holds the rollout engine, so the gathered HF tensors go straight into it.

Buckets, trailers and checksums exist for the wire; in one process they would copy every weight twice more (into a
bucket, out of it) and check bytes that never left memory. Here the exporter's tensors stream into
``engine.load_weights`` one at a time, each checked against the plan (a name it lists, once; its shape) and cast to
the plan's dtype: one copy, into the engine's weights, and no buffers kept between syncs. At Qwen3-0.6B's shape on
the CPU that is 0.33 s a sync against 1.33 s through packed buckets (docs/performance.md).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator

import torch

from megatron_gkd.models import export_hf_weights, parallel_state_of
from megatron_gkd.weight_sync.config import WeightSyncConfig
from megatron_gkd.weight_sync.errors import WeightSyncError
from megatron_gkd.weight_sync.plan import WeightSyncPlan
from megatron_gkd.weight_sync.verify import check_prompt_logprobs, student_prompt_logprobs, verification

logger = logging.getLogger(__name__)


def planned_tensors(plan: WeightSyncPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` checked against ``plan`` and cast to its dtypes, in the order they come.

    Raises:
        WeightSyncError: a name the plan does not list or lists once and came twice, a shape other than the plan's,
            or (at the end) a planned tensor that never came.
    """
    entries = {entry.name: entry for entry in plan.entries}
    seen: set[str] = set()
    for name, tensor in tensors:
        entry = entries.get(name)
        if entry is None or name in seen:
            why = "came twice" if entry is not None else "is not in the weight-sync plan"
            raise WeightSyncError(f"the exporter's tensor {name!r} {why}: the plan was built for another model")
        if tuple(tensor.shape) != tuple(entry.shape):
            raise WeightSyncError(f"the exporter's tensor {name!r} has shape {tuple(tensor.shape)}, the plan's is "
                                  f"{tuple(entry.shape)}: the plan was built for another model")
        seen.add(name)
        yield name, tensor.to(entry.torch_dtype)
    if len(seen) != len(entries):
        missing = [name for name in entries if name not in seen]
        raise WeightSyncError(f"the exporter never produced {len(missing)} planned tensors ({missing[0]!r}, ...)")


class ColocatedReceiver:
    """The engine's side of colocated syncs: the version it holds and the checks of each sync."""

    def __init__(self, plan: WeightSyncPlan, config: WeightSyncConfig):
        self.plan, self.config = plan, config
        self.version = 0
        self.last_sync_s = 0.0

    def sync(self, engine, tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """Loads the exporter's ``tensors`` into ``engine`` as weights ``version``; returns it.

        ``tensors`` is read to its end whatever happens (its gathers are collectives of every trainer rank).

        Raises:
            WeightSyncError: ``version`` is not newer than the last, or the engine failed to load the tensors (it is
                then stale: it refuses to generate until a sync succeeds).
        """
        start = time.perf_counter()
        try:
            if version <= self.version:
                raise WeightSyncError(f"weight version {version} is not newer than the engine's {self.version}")
            engine.load_weights(planned_tensors(self.plan, tensors), version=version)
        except Exception as error:
            logger.error("weight version %s was not loaded (%s: %s); the engine refuses to generate until a sync "
                         "succeeds", version, type(error).__name__, error)
            if isinstance(error, WeightSyncError):
                raise
            raise WeightSyncError(f"weight version {version} was not loaded: {type(error).__name__}: {error}") from error
        finally:
            for _ in tensors:  # what is left after a failure (or an engine that stopped reading): other ranks' gathers
                pass
        self.version = version
        self.last_sync_s = time.perf_counter() - start
        return version

    def verify(self, engine, expected_logprobs: torch.Tensor, check: float | None = None) -> float:
        """Marks ``engine`` stale and raises :class:`~megatron_gkd.weight_sync.verify.WeightSyncMismatch` unless its
        log-probs on ``config.verify_prompts`` are the student's (``check``: the periodic check's tolerance, see
        :func:`~megatron_gkd.weight_sync.verify.verification`); returns the error."""
        tolerance, mean = verification(self.config, check) or (self.config.verify_tolerance, False)
        try:
            got = engine.prompt_logprobs(self.config.verify_prompts)
            return check_prompt_logprobs(got, expected_logprobs, tolerance, self.version, mean=mean)
        except WeightSyncError as error:
            engine.mark_stale(str(error))
            raise


def colocated_sync(chunks, engine, plan: WeightSyncPlan, config: WeightSyncConfig, version: int, *,
                   receiver: ColocatedReceiver | None = None, check: float | None = None) -> ColocatedReceiver | None:
    """One sync where the trainer rank holds the rollout engine (or ``engine=None`` on ranks without one); verified
    with ``config.verify``, or, with ``check`` (a tolerance in nats), as the periodic engine check.

    Every trainer rank calls it (the exporter's gathers are collectives, and so is ``verify``'s forward of the
    student). Needs every tensor on the engine's rank after the TP and expert-parallel gathers: pipeline parallel
    size 1.

    Returns:
        the receiver (pass it back next time) on ranks with an engine, else ``None``.
    """
    if parallel_state_of(chunks[0]).pp_size > 1:
        raise ValueError(
            "weight_sync.transport='colocated' needs pipeline parallel size 1 (a rank holds only its stage's "
            "weights); use transport='distributed'"
        )
    tensors = iter(export_hf_weights(chunks, owner_only=False, all_experts=True))
    if engine is None:
        for _ in tensors:
            pass
        if verification(config, check) is not None:
            student_prompt_logprobs(chunks, config.verify_prompts)
        return None
    receiver = receiver or ColocatedReceiver(plan, config)
    try:
        receiver.sync(engine, tensors, version)
    finally:
        # After the stream, on every rank whatever happened: the student's forward is a TP collective too.
        verifies = verification(config, check) is not None
        expected = student_prompt_logprobs(chunks, config.verify_prompts) if verifies else None
    if expected is not None:
        receiver.verify(engine, expected, check)
    return receiver
