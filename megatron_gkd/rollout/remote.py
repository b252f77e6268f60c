"""Disaggregated layout: a dedicated rank serves the rollout engine; trainer ranks ask it for batches.

All members of ``group`` (trainer ranks and the serving rank) take part in every exchange. A message is
msgpack (never pickle: a rank cannot make another run code) broadcast as a length and a byte tensor::

    request  (source: the first trainer rank)  {"op": "generate", prompts, sampling}
                                               {"op": "update", version}   new weights follow
                                               {"op": "stop"}
    reply    (source: the serving rank)        {"batch": RolloutBatch} or {"error": message}

so every trainer rank receives the same batch. The serving rank runs :meth:`RolloutServer.serve` until
a trainer closes the client. A rejected request (e.g. prompts too long) comes back to the trainers as
the same ``ValueError`` and the server keeps serving. Between two requests the server can take new
weights: on ``update`` it receives them with its weight receiver (the trainer ranks send them with
their :class:`~megatron_gkd.weight_sync.WeightSender` right after :meth:`RolloutClient.update_weights`).
An update that fails (a corrupted bucket, a reload error, a sender past its timeout) leaves the engine
stale: the server keeps serving, answers ``generate`` with a
:class:`~megatron_gkd.rollout.engine.StaleWeightsError` that the trainers receive, and takes the next
update (the trainers' ``sender.sync`` raised, and they may retry).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import msgpack
import torch

from megatron_gkd.rollout.engine import RolloutEngine, StaleWeightsError
from megatron_gkd.rollout.registry import ENGINES
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig, decode_batch, encode_batch
from megatron_gkd.weight_sync.errors import WeightSyncError

logger = logging.getLogger(__name__)

def _broadcast(message: dict | None, src: int, group) -> dict:
    """``message`` (msgpack) from group rank ``src`` to every member of ``group`` (a gloo process
    group: one made by ``new_group`` or one on its own store, such as a weight-sync transport's)."""
    payload = msgpack.packb(message, use_bin_type=True) if message is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    group.broadcast(size, src).wait()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if message is not None else torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(data, src).wait()
    return msgpack.unpackb(data.numpy().tobytes(), raw=False)


class RolloutServer:
    """Serves ``engine`` to the trainer ranks of ``group`` (runs on the serving rank).

    Args:
        engine: the engine that samples (a vLLM engine outside the trainers' world).
        group: the gloo group of the trainer ranks and this rank.
        server_rank, trainer_rank: ranks in ``group`` of this rank and of the rank whose requests count.
        receiver: the weight receiver ``update`` requests use (``receiver.sync(engine, expect_version=v)``);
            may be attached later with :meth:`attach_receiver`.
    """

    def __init__(self, engine: RolloutEngine, group, server_rank: int, trainer_rank: int, receiver=None):
        self.engine, self._group, self._server_rank, self._trainer_rank = engine, group, server_rank, trainer_rank
        self.receiver = receiver

    def attach_receiver(self, receiver) -> None:
        """The weight receiver that ``update`` requests feed into the engine."""
        self.receiver = receiver

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def serve(self) -> int:
        """Answers requests until the trainers close; returns the number of generate requests answered."""
        answered = 0
        while True:
            request = _broadcast(None, self._trainer_rank, self._group)
            op = request.get("op")
            if op == "stop":
                logger.info("rollout server stops after %d requests", answered)
                return answered
            if op == "update":
                if self.receiver is None:
                    raise RuntimeError("rollout server got new weights but has no weight receiver attached")
                try:
                    self.receiver.sync(self.engine, expect_version=int(request["version"]), check=request.get("check"))
                except WeightSyncError as error:
                    logger.error("rollout server: the update to weight version %s failed (%s); serving on, the engine "
                                 "refuses to generate until an update succeeds", request["version"], error)
                continue
            if op != "generate":
                raise RuntimeError(f"rollout server got an unknown request {op!r}")
            try:
                sampling = SamplingConfig(**request["sampling"])
                reply = {"batch": encode_batch(self.engine.generate(request["prompts"], sampling))}
            except StaleWeightsError as error:
                reply = {"error": str(error), "stale": True}
            except ValueError as error:
                reply = {"error": str(error)}
            _broadcast(reply, self._server_rank, self._group)
            answered += 1

    def close(self) -> None:
        self.engine.close()


class RolloutClient(RolloutEngine):
    """The trainer ranks' side: ``generate`` sends the prompts to the serving rank, returns its batch.

    Every trainer rank of ``group`` calls :meth:`generate` and :meth:`update_weights` (collectively)
    with the same arguments; only the first trainer rank's are sent.
    """

    def __init__(self, group, server_rank: int, trainer_rank: int, max_model_len: int):
        self._group, self._server_rank, self._trainer_rank = group, server_rank, trainer_rank
        super().__init__(max_model_len)  # weight_version: that of the last batch received
        self._closed = False

    @property
    def _connection(self):
        if self._group is None:
            raise ConnectionError("this rank dropped its connection to the rollout server after a failure on it")
        return self._group

    def abandon(self) -> None:
        """Drops the group (after a failure on it; the caller drops its other references): requests then raise."""
        self._group = None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        request = {"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
                   "sampling": dataclasses.asdict(sampling)}
        _broadcast(request, self._trainer_rank, self._connection)
        reply = _broadcast(None, self._server_rank, self._connection)
        if reply.get("stale"):
            raise StaleWeightsError(f"rollout server: {reply['error']}")
        if "error" in reply:
            raise ValueError(f"rollout server rejected the request: {reply['error']}")
        batch = decode_batch(reply["batch"])
        self._weight_version = batch.weight_version
        return batch

    def update_weights(self, version: int, check: float | None = None) -> None:
        """Tells the server to receive weights ``version`` now; the trainers' sender must send them next (``check``:
        the server verifies the engine with this tolerance, the periodic engine check)."""
        _broadcast({"op": "update", "version": int(version), "check": check}, self._trainer_rank, self._connection)

    def close(self) -> None:
        """Stops the server (collective over the trainer ranks and the serving rank)."""
        if not self._closed:
            _broadcast({"op": "stop"}, self._trainer_rank, self._connection)
            self._closed = True


def new_rollout_group(ranks: Sequence[int]):
    """A gloo group of ``ranks`` for the control messages (collective: every rank of the world calls it)."""
    return torch.distributed.new_group(ranks=sorted(ranks), backend="gloo")


def build_disaggregated(*, engine: str = "vllm", group=None, server_rank: int, trainer_rank: int = 0,
                        max_model_len: int = 1024, **engine_kwargs) -> RolloutServer | RolloutClient:
    """On ``server_rank``: a :class:`RolloutServer` around engine ``engine``; elsewhere: a client.

    Args:
        engine: the registered engine the serving rank runs (outside the trainers' world:
            ``join_world=False``).
        group: gloo group with the trainer ranks and the serving rank (default: the world; see
            :func:`new_rollout_group`), or one on its own store such as a weight-sync transport's
            ``world`` (the rollout processes then need no torch.distributed world of their own).
        server_rank: rank in ``group`` that serves the engine.
        trainer_rank: rank in ``group`` whose requests are sent.
        max_model_len: passed to the engine; the client reports it.
        engine_kwargs: the engine's arguments (serving rank only).
    """
    if server_rank == trainer_rank:
        raise ValueError(f"rollout server_rank={server_rank} must differ from trainer_rank in the "
                         "disaggregated layout (use layout='colocated' to share ranks)")
    group = group if group is not None else torch.distributed.group.WORLD
    if group.rank() == server_rank:
        served = ENGINES.build(engine, max_model_len=max_model_len, join_world=False, **engine_kwargs)
        return RolloutServer(served, group, server_rank, trainer_rank)
    return RolloutClient(group, server_rank, trainer_rank, max_model_len)
