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

Colocated (the trainer rank holds the engine): :func:`colocated_sync` streams the gathered tensors into the
engine, without buckets (:mod:`megatron_gkd.weight_sync.colocated`).

Failures fail closed: a sync that does not complete leaves the rollout engines refusing to generate
(``engine.stale``) until one does, and raises :class:`WeightSyncError` on every rank (trainers may
retry). Once begun, each operation of a sync must finish within the transport's ``timeout_s``.
"""

from __future__ import annotations

from megatron_gkd.weight_sync.buckets import BucketSpec, ChecksumMismatch, PartSpec, layout_buckets
from megatron_gkd.weight_sync.colocated import ColocatedReceiver, colocated_sync
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


__all__ = [
    "BucketSpec",
    "PartSpec",
    "ChecksumMismatch",
    "ColocatedReceiver",
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
