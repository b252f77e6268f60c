"""The trainer's handle on its rollout engine, one owner: the colocated engine (of the :mod:`megatron_gkd.rollout`
package) or the rollout server, sampling, and weight sync.

Built by :func:`megatron_gkd.trainer.components.build_rollout` and passed to the parts that sample (the
batch flow, the evaluator) and to the trainer, which tells it when new weights exist. Every call is a
collective of the trainer ranks (a broadcast of the sampled batch, a weight-sync bucket).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch.distributed as dist

from megatron_gkd.config import student_samples
from megatron_gkd.parallel.comm import all_gather_msgpack, broadcast_msgpack
from megatron_gkd.rollout.types import RolloutBatch, concat_batches, decode_batch, encode_batch
from megatron_gkd.trainer import engine_check
from megatron_gkd.weight_sync import colocated_sync


class Rollout:
    """Samples with the student's current weights and keeps the engine's weights current.

    Args:
        config: the run's :class:`~megatron_gkd.config.GKDConfig`.
        control: a gloo group over every trainer rank.
        stop_ids: ids that end a response (added to every request's sampling).
        timers: the trainer's phase timers (``weight_sync``).
        engine: this rank's colocated engine (a vLLM shard, or the student itself), or None.
        remote: the :class:`~megatron_gkd.trainer.rollout_server.RemoteRollout` (rollout server), or None.
        sync_plan: the weight-sync plan of a colocated engine that holds its own copy of the weights.
        replicas: colocated engine replicas (each samples a block of the prompts): vLLM's of rollout TP, or ``hf``'s, one a rank.
    """

    def __init__(self, config, *, control, stop_ids, timers, engine=None, remote=None, sync_plan=None, replicas: int = 1):
        if (engine is None) == (remote is None):
            raise ValueError("a Rollout needs exactly one of a colocated engine and a rollout server")
        self.config, self.control, self.stop_ids, self.timers = config, control, tuple(stop_ids), timers
        self.engine, self.remote, self._plan = engine, remote, sync_plan
        self.replicas = 1 if engine is not None and engine.shares_student_weights else replicas
        self.rank = dist.get_rank()
        self.version = 0  # the student weights the engine (or server) holds
        self._receiver = None
        self._syncs = 0
        self._check_tolerance = engine_check.tolerance_of(config)

    @property
    def in_background(self) -> bool:
        """Whether batches are sampled on the rollout server's thread while the trainer ranks train."""
        return self.remote is not None

    def _with_stop_ids(self, sampling):
        return dataclasses.replace(sampling, stop_token_ids=tuple(sorted(set(sampling.stop_token_ids) | set(self.stop_ids))))

    def generate(self, prompts: list[list[int]], sampling) -> RolloutBatch:
        """Samples ``prompts``; every rank returns the same batch."""
        sampling = self._with_stop_ids(sampling)
        if self.remote is not None:
            return self.remote.generate(prompts, sampling)
        if self.replicas == 1:
            batch = self.engine.generate(prompts, sampling)
            return decode_batch(broadcast_msgpack(encode_batch(batch) if self.rank == 0 else None, 0, self.control))
        # Each replica samples a block of prompts, seeded as one engine would seed them all.
        blocks = np.array_split(np.arange(len(prompts)), self.replicas)
        tp = self.config.rollout.tensor_parallel_size
        mine = blocks[self.rank // tp]
        seed = None if sampling.seed is None else sampling.seed + int(mine[0] if len(mine) else 0) * sampling.n
        if len(mine):
            batch = self.engine.generate([prompts[i] for i in mine], dataclasses.replace(sampling, seed=seed))
        else:  # fewer prompts than replicas (GKD's mixture samples only some of a batch's prompts)
            # vLLM's data-parallel replicas step together: one without prompts that skipped generate would leave the
            # others waiting for it. It samples one token of a prompt and drops it.
            self.engine.generate(prompts[:1], dataclasses.replace(sampling, seed=seed, max_tokens=1, n=1))
            batch = None
        gathered = all_gather_msgpack(None if batch is None else encode_batch(batch), self.control)
        return concat_batches([decode_batch(gathered[r * tp]) for r in range(self.replicas) if gathered[r * tp]])

    def generate_then(self, prompts: list[list[int]], sampling, then):
        """Rollout server only: ``then(batch)``, sampled and run on the rollout thread, after what was asked before it
        (weight updates included); a :class:`~megatron_gkd.trainer.rollout_server.ServerCall`, whose ``result()``
        asks again if the server dies first."""
        sampling = self._with_stop_ids(sampling)
        return self.remote.call(lambda: self.remote.client.generate(prompts, sampling), then)

    def sync(self, chunks, version: int, *, force: bool = False) -> None:
        """Puts weights ``version`` into the engine: every step while the student samples; otherwise only when
        ``force``d (off-policy, SFT and a mixture that never draws the student sample nothing, eval refreshes the
        engine). The first sync of this process and every ``weight_sync.check_interval``-th version are verified as
        the periodic engine check (:mod:`.engine_check`: every scheduler and layout, where the sampled tokens' check
        covers only tokens sampled with the weights being trained).

        Raises:
            WeightSyncError: the sync failed, or its check found the engine computing other weights (colocated; a
                rollout server's engine refuses to generate instead, which the next rollout reports).
        """
        if self.version == version or not (force or student_samples(self.config)):
            return
        interval = self.config.weight_sync.check_interval
        check = self._check_tolerance if interval and (self._syncs == 0 or version % interval == 0) else None
        with self.timers("weight_sync"):
            if self.remote is not None:
                self.remote.sync(chunks, version, check)
            elif self.engine.shares_student_weights:  # the engine is the student: nothing can be stale
                self.engine.load_weights(iter(()), version)
            else:
                self._receiver = colocated_sync(chunks, self.engine, self._plan, self.config.weight_sync, version=version,
                                                receiver=self._receiver, check=check)
        self.version = version
        self._syncs += 1

    def release(self) -> None:
        """Before the trainer changes the student's weights: an engine that reads them in place
        (``rollout.release_weights``) drops them, and refuses to sample until the next :meth:`sync` restores them.
        Every sampling happens between a sync and the next update, so no sample waits for a restore."""
        if self.engine is not None and self.engine.releases_weights:
            self.engine.release_weights()

    def metrics(self) -> dict:
        """``rollout/server_restarts``: the rollout servers that died and were replaced so far (the same on every rank)."""
        return {"rollout/server_restarts": self.remote.epoch} if self.remote is not None else {}

    def close(self) -> None:
        """Stops the engine or the rollout server (every rank)."""
        (self.remote or self.engine).close()
