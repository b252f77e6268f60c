"""Weight sync: the trainer's new weights into the rollout engine, fast and provably fresh.

Trainer side (every trainer rank)::

    plan = build_plan(chunks)                                  # once, collective
    transport = get_transport("distributed")(address=..., port=..., rank=trainer_rank,
                                             num_trainer_ranks=T, num_rollout_ranks=R)
    connect_trainer(plan, transport)
    sender = WeightSender(plan, transport, config)
    sender.sync(chunks, version)                               # after each optimizer step

Rollout side (each rollout rank)::

    plan = connect_rollout(transport)                          # the plan arrives once
    receiver = WeightReceiver(plan, transport, config)
    receiver.sync(engine)                                      # a RolloutEngine -> new weight version

Every TP rank of the first data-parallel replica sends its own slices (no all-gather);
``WeightSyncConfig.transfer`` chooses ``packed`` bucket buffers or ``direct`` broadcasts into a
receive arena (see :class:`~megatron_gkd.weight_sync.config.WeightSyncConfig`).

Colocated (the trainer rank holds the engine): :func:`colocated_sync`, no broadcast.

Failures fail closed: a sync that does not complete leaves the rollout engines refusing to generate
(``engine.stale``) until one does, and raises :class:`WeightSyncError` on every rank (trainers may
retry). Once begun, each operation of a sync must finish within the transport's ``timeout_s``.
"""

from __future__ import annotations

from megatron_gkd.models import parallel_state_of
from megatron_gkd.weight_sync.buckets import BucketSpec, ChecksumMismatch, PartSpec, layout_buckets
from megatron_gkd.weight_sync.config import WeightSyncConfig
from megatron_gkd.weight_sync.errors import WeightSyncError, WeightSyncTransportError
from megatron_gkd.weight_sync.plan import TensorSpec, WeightSyncPlan, build_plan
from megatron_gkd.weight_sync.receiver import WeightReceiver, reload_vllm_weights
from megatron_gkd.weight_sync.sender import WeightSender
from megatron_gkd.weight_sync.transports import (
    TRANSPORTS,
    ColocatedTransport,
    SignedStore,
    TorchDistributedTransport,
    get_transport,
    register_transport,
)
from megatron_gkd.weight_sync.verify import WeightSyncMismatch, check_prompt_logprobs, student_prompt_logprobs, vllm_prompt_logprobs


def connect_trainer(plan: WeightSyncPlan, transport) -> None:
    """Trainer ranks: send the plan to the rollout ranks (from trainer rank 0) and build the groups."""
    transport.share_text(plan.to_json() if transport.rank == 0 else None, src=0)
    transport.connect(plan.senders)


def connect_rollout(transport) -> WeightSyncPlan:
    """Rollout ranks: the plan (once) and the groups."""
    plan = WeightSyncPlan.from_json(transport.share_text(None, src=0))
    transport.connect(plan.senders)
    return plan


def colocated_sync(chunks, engine, plan: WeightSyncPlan, config: WeightSyncConfig, version: int, *, receiver=None):
    """One sync where the trainer rank holds the rollout engine (or ``engine=None`` on ranks without one).

    Every trainer rank calls it (the exporter's gathers are collectives). Needs every tensor on the
    engine's rank after the TP and expert-parallel gathers: pipeline parallel size 1.

    Returns:
        the receiver (pass it back next time) on ranks with an engine, else ``None``.
    """
    if parallel_state_of(chunks[0]).pp_size > 1:
        raise ValueError(
            "weight_sync.transport='colocated' needs pipeline parallel size 1 (a rank holds only its stage's "
            "weights); use transport='distributed'"
        )
    sender = WeightSender(plan, None, config, owns_all=True)
    stream = sender.packed(chunks, version)
    if engine is not None:
        transport = ColocatedTransport()
        transport.bind(stream, version)
        receiver = receiver or WeightReceiver(plan, transport, config)
        receiver.transport = transport
        try:
            receiver.sync(engine, verify=False, expect_version=version)
        except WeightSyncError:
            # The engine is stale; the stream was drained (the exporter's gathers are collectives),
            # and the verify forward below is one too, so the other ranks are not left waiting.
            if config.verify:
                sender.share_student_logprobs(chunks)
            raise
        # After the stream: the student's forward is a TP collective like the exporter's gathers.
        if config.verify:
            try:
                receiver.verify(engine, sender.share_student_logprobs(chunks))
            except WeightSyncError as error:
                engine.mark_stale(str(error))
                raise
        return receiver
    for _ in stream:
        pass
    if config.verify:
        sender.share_student_logprobs(chunks)
    return None


__all__ = [
    "BucketSpec",
    "PartSpec",
    "ChecksumMismatch",
    "ColocatedTransport",
    "TRANSPORTS",
    "TensorSpec",
    "SignedStore",
    "TorchDistributedTransport",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightSyncTransportError",
    "WeightSyncMismatch",
    "WeightSyncPlan",
    "build_plan",
    "check_prompt_logprobs",
    "colocated_sync",
    "connect_rollout",
    "connect_trainer",
    "get_transport",
    "layout_buckets",
    "reload_vllm_weights",
    "register_transport",
    "student_prompt_logprobs",
    "vllm_prompt_logprobs",
]
