"""Disaggregated layout: a dedicated rank serves the rollout engine; trainer ranks ask it for batches.

All members of ``group`` (trainer ranks and the serving rank) take part in every exchange, over the
platform's backend (gloo on CPU), in two ``broadcast_object_list`` calls::

    request  (source: the first trainer rank)  prompts + SamplingConfig, or None to stop
    reply    (source: the serving rank)        RolloutBatch, or the error message of a failed request

so every trainer rank receives the same batch. The serving rank runs :meth:`RolloutServer.serve`
until a trainer closes the client. A rejected request (e.g. prompts too long) comes back to the
trainers as the same ``ValueError`` and the server keeps serving.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from megatron_gkd.rollout.registry import RolloutEngine
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig

logger = logging.getLogger(__name__)


def _broadcast(value, src: int, group) -> object:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]


class RolloutServer:
    """Serves ``engine`` to the trainer ranks of ``group`` (runs on the serving rank)."""

    def __init__(self, engine: RolloutEngine, group, server_rank: int, trainer_rank: int):
        self.engine, self._group, self._server_rank, self._trainer_rank = engine, group, server_rank, trainer_rank

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def serve(self) -> int:
        """Answers requests until the trainers close; returns the number of requests answered."""
        answered = 0
        while True:
            request = _broadcast(None, self._trainer_rank, self._group)
            if request is None:
                logger.info("rollout server stops after %d requests", answered)
                return answered
            prompts, sampling = request
            try:
                reply = self.engine.generate(prompts, sampling)
            except ValueError as error:
                reply = str(error)
            _broadcast(reply, self._server_rank, self._group)
            answered += 1

    def close(self) -> None:
        self.engine.close()


class RolloutClient(RolloutEngine):
    """The trainer ranks' side: ``generate`` sends the prompts to the serving rank, returns its batch.

    Every trainer rank of ``group`` calls :meth:`generate` (collectively) with the same arguments;
    only the first trainer rank's prompts are sent.
    """

    def __init__(self, group, server_rank: int, trainer_rank: int, max_model_len: int):
        self._group, self._server_rank, self._trainer_rank = group, server_rank, trainer_rank
        super().__init__(max_model_len)  # weight_version: that of the last batch received
        self._closed = False

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        _broadcast(([list(map(int, p)) for p in prompts], sampling), self._trainer_rank, self._group)
        reply = _broadcast(None, self._server_rank, self._group)
        if isinstance(reply, str):
            raise ValueError(f"rollout server rejected the request: {reply}")
        self._weight_version = reply.weight_version
        return reply

    def close(self) -> None:
        """Stops the server (collective over the trainer ranks and the serving rank)."""
        if not self._closed:
            _broadcast(None, self._trainer_rank, self._group)
            self._closed = True


def new_rollout_group(ranks: Sequence[int]):
    """A ``torch.distributed`` group of ``ranks`` on the platform's backend (collective: every rank calls it)."""
    from megatron_gkd import platform

    return torch.distributed.new_group(ranks=sorted(ranks), backend=platform.dist_backend())


def build_disaggregated(*, group=None, server_rank: int, trainer_rank: int = 0, max_model_len: int = 1024,
                        **engine_kwargs) -> RolloutServer | RolloutClient:
    """On ``server_rank``: a :class:`RolloutServer` around a vLLM engine; elsewhere: a client.

    Args:
        group: ``torch.distributed`` group with the trainer ranks and the serving rank (default world;
            see :func:`new_rollout_group`).
        server_rank: global rank that serves the engine.
        trainer_rank: global rank whose prompts are sent.
        max_model_len: passed to the engine; the client reports it.
        engine_kwargs: :class:`~megatron_gkd.rollout.vllm_engine.VLLMEngine` arguments (serving rank).
    """
    if server_rank == trainer_rank:
        raise ValueError(f"rollout server_rank={server_rank} must differ from trainer_rank in the "
                         "disaggregated layout (use layout='colocated' to share ranks)")
    if torch.distributed.get_rank() == server_rank:
        from megatron_gkd.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(max_model_len=max_model_len, join_world=False, **engine_kwargs)
        return RolloutServer(engine, group, server_rank, trainer_rank)
    return RolloutClient(group, server_rank, trainer_rank, max_model_len)
