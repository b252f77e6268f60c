"""The trainer's side of the disaggregated rollout: a rollout server process, its transport, its thread.

Trainer rank 0 starts ``python -m megatron_gkd.rollout.server`` (vLLM outside the trainers' world) and
hosts the weight-sync store; every trainer rank joins the transport, sends the plan, and talks to the
server through a :class:`~megatron_gkd.rollout.remote.RolloutClient` on the transport's control
group. Everything that uses that group (generate requests, weight updates) runs on one thread, in the
order it was asked for, so rollout overlaps training while updates and requests never interleave; a
weight update blocks the caller until the parameters have been read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import secrets
import sys

from megatron_gkd.child_process import ServiceProcess, free_port
from megatron_gkd.parallel.comm import agree, broadcast_msgpack
from megatron_gkd.rollout.remote import RolloutClient
from megatron_gkd.rollout.server import SECRET_ENV
from megatron_gkd.weight_sync import TorchDistributedTransport, WeightSender, build_plan, connect_trainer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # building vLLM under load took up to 145 s here; a large model takes longer


class RemoteRollout:
    """Starts the rollout server (rank 0), connects every trainer rank, and serialises its traffic.

    Args:
        config: the run's :class:`~megatron_gkd.config.GKDConfig`.
        chunks: the student's chunks (the weight-sync plan is built from them; collective).
        engine_kwargs: the rollout engine's arguments (model path, sizes, ...).
        log_path: the server's log file.
        control: a gloo group over the trainer ranks (start-up agreement).
    """

    def __init__(self, config, chunks, engine_kwargs: dict, log_path, control):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        self.service = None
        error, port, secret = None, None, None
        if rank == 0:
            try:
                port, secret = free_port(), secrets.token_hex(32)
                sync = dataclasses.asdict(config.weight_sync)
                args = [sys.executable, "-m", "megatron_gkd.rollout.server", "--exit-with-parent", "--port", str(port),
                        "--num-trainer-ranks", str(world), "--engine", config.rollout.engine,
                        "--engine-kwargs", json.dumps(engine_kwargs), "--weight-sync", json.dumps(sync)]
                self.service = ServiceProcess("rollout server", args, log_path, env={SECRET_ENV: secret},
                                              ready=r"READY rollout server")
                self.service.wait_ready(STARTUP_TIMEOUT_S)
            except Exception as caught:  # noqa: BLE001 - every rank stops with it
                error = caught
        agree(error, control)
        port, secret = broadcast_msgpack([port, secret], 0, control)
        self.transport = TorchDistributedTransport(address="127.0.0.1", port=port, rank=rank, num_trainer_ranks=world,
                                                   num_rollout_ranks=1, secret=secret)
        plan = build_plan(chunks)
        connect_trainer(plan, self.transport)
        self.sender = WeightSender(plan, self.transport, config.weight_sync)
        self.client = RolloutClient(self.transport.world, server_rank=world, trainer_rank=0,
                                    max_model_len=config.rollout.max_model_len)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Runs ``fn(*args)`` on the rollout thread, after everything submitted before."""
        return self._thread.submit(fn, *args)

    def generate(self, prompts, sampling):
        """A batch (every trainer rank gets the same), waiting for requests queued before it."""
        return self.submit(self.client.generate, prompts, sampling).result()

    def sync(self, chunks, version: int, check: float | None = None) -> None:
        """Sends weights ``version`` to the server (after queued rollouts); returns once they are sent (``check``: the
        server verifies them with this tolerance, the periodic engine check: a failure leaves its engine refusing to
        generate, which the next rollout reports)."""
        def update():
            self.client.update_weights(version, check)
            self.sender.sync(chunks, version, check=check is not None)

        self.submit(update).result()

    def close(self) -> None:
        """Stops the server (collective over the trainer ranks), the thread and the transport."""
        try:
            self.submit(self.client.close).result(timeout=300)
        finally:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self.transport.close()
            if self.service is not None:
                self.service.stop()
