"""The trainer's side of the disaggregated rollout: a rollout server process, its transport, its thread.

Trainer rank 0 starts ``python -m megatron_gkd.rollout.server`` (vLLM outside the trainers' world) and
hosts the weight-sync store; every trainer rank joins the transport, sends the plan, and talks to the
server through a :class:`~megatron_gkd.rollout.remote.RolloutClient` on the transport's control
group. Everything that uses that group (generate requests, weight updates) runs on one thread, in the
order it was asked for, so rollout overlaps training while updates and requests never interleave; a
weight update blocks the caller until the parameters have been read.

A server that dies (killed, out of memory, its engine dead) is replaced, not fatal (:class:`ServerCall`): the trainer
ranks notice it where they wait for a request, rank 0 starts a new server, every rank connects to it, the student's
current weights go in (verified like the periodic engine check), and the requests the dead server had not answered are
asked again. ``rollout.max_restarts`` bounds the restarts of a run; ``rollout/server_restarts`` counts them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import secrets
import subprocess
import sys
import traceback

from megatron_gkd.child_process import ServiceProcess, free_port
from megatron_gkd.parallel.comm import agree, broadcast_msgpack
from megatron_gkd.rollout.engine import StaleWeightsError
from megatron_gkd.rollout.remote import RolloutClient
from megatron_gkd.rollout.server import SECRET_ENV
from megatron_gkd.trainer import engine_check
from megatron_gkd.weight_sync import TorchDistributedTransport, WeightSender, build_plan, connect_trainer
from megatron_gkd.weight_sync.errors import WeightSyncError, WeightSyncTransportError

logger = logging.getLogger(__name__)
ANSWERED = (ValueError, StaleWeightsError, WeightSyncError)
"""What a request raises when the server answered it with an error (it lived); a
:class:`~megatron_gkd.weight_sync.errors.WeightSyncTransportError` is not one."""

STARTUP_TIMEOUT_S = 900.0  # building vLLM under load took up to 145 s here; a large model takes longer
DEATH_GRACE_S = 5.0  # how long a request's failure waits for the server to be seen dead


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
        self.config, self.chunks, self._engine_kwargs, self._log_path, self._control = \
            config, chunks, engine_kwargs, pathlib.Path(log_path), control
        self.service = self.transport = None
        self.epoch = 0
        """Servers started before the current one (``rollout/server_restarts``)."""
        self.version = 0
        """The student's weights the server holds (what a new server is given)."""
        self._tolerance = engine_check.tolerance_of(config)  # a new server's weights are verified
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._start()

    def _start(self) -> None:
        """Starts the server (rank 0) and connects every trainer rank to it (collective over the trainer ranks)."""
        import torch.distributed as dist

        rank, world, config = dist.get_rank(), dist.get_world_size(), self.config
        error, port, secret = None, None, None
        if rank == 0:
            try:
                port, secret = free_port(), secrets.token_hex(32)
                sync = dataclasses.asdict(config.weight_sync)
                args = [sys.executable, "-m", "megatron_gkd.rollout.server", "--exit-with-parent", "--port", str(port),
                        "--num-trainer-ranks", str(world), "--engine", config.rollout.engine,
                        "--engine-kwargs", json.dumps(self._engine_kwargs), "--weight-sync", json.dumps(sync)]
                log = self._log_path if not self.epoch else self._log_path.with_suffix(f".{self.epoch}.log")
                self.service = ServiceProcess("rollout server", args, log, env={SECRET_ENV: secret},
                                              ready=r"READY rollout server")
                self.service.wait_ready(STARTUP_TIMEOUT_S)
            except Exception as caught:  # noqa: BLE001 - every rank stops with it
                error = caught
        agree(error, self._control)
        port, secret = broadcast_msgpack([port, secret], 0, self._control)
        self.transport = TorchDistributedTransport(address="127.0.0.1", port=port, rank=rank, num_trainer_ranks=world,
                                                   num_rollout_ranks=1, secret=secret)
        plan = build_plan(self.chunks)
        connect_trainer(plan, self.transport)
        self.sender = WeightSender(plan, self.transport, config.weight_sync)
        self.client = RolloutClient(self.transport.world, server_rank=world, trainer_rank=0,
                                    max_model_len=config.rollout.max_model_len)

    def submit(self, fn, then=None) -> concurrent.futures.Future:
        """Runs ``then(fn())`` on the rollout thread, after everything submitted before: ``fn`` talks to the server,
        ``then`` uses its answer (``None``: the answer itself). The future's value is ``(epoch, result)``, the server
        it ran on; a failure is a :class:`ServerJobFailed` that says so too, and whether the server's connection
        failed (``lost``): this rank then drops the connection, so that every trainer rank's wait on it ends too."""
        def job():
            epoch = self.epoch
            try:
                answer = fn()
            except Exception as error:
                lost = isinstance(error, WeightSyncTransportError) or not isinstance(error, ANSWERED)
                if lost:
                    self._abandon(error)
                raise ServerJobFailed(epoch, error, lost=lost) from error
            try:
                return epoch, answer if then is None else then(answer)
            except Exception as error:
                raise ServerJobFailed(epoch, error, lost=False) from error

        return self._thread.submit(job)

    def _abandon(self, error: BaseException) -> None:
        """Drops this rank's connection to the server (after a failure on it): gloo closes a group's sockets when the
        last reference to it goes, and the other trainer ranks' pending operations with this rank then fail at once,
        instead of waiting for a message this rank will not send (up to ``weight_sync``'s idle timeout)."""
        self.client.abandon()
        self.sender = None
        self.transport.close()
        while error is not None:  # the failed calls' frames hold the group too
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__

    def died(self, lost: bool) -> str | None:
        """How the current server ended (``"exit code -9"``), or None while it runs: trainer rank 0 knows, every
        trainer rank learns it (collective over the trainer ranks). ``lost``: rank 0's connection to the server failed
        (else the server answered, or rank 0's request did not fail: no grace for its death)."""
        code = None
        if self.service is not None and not lost:
            code = self.service.process.poll()
        elif self.service is not None:
            try:  # a killed server's sockets close a moment before the process can be reaped
                code = self.service.process.wait(timeout=DEATH_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        return broadcast_msgpack(None if code is None else f"exit code {code}", 0, self._control)

    def restart(self, version: int, check: float | None) -> None:
        """Starts a new server in place of the dead one and puts the student's weights ``version`` into it (read from
        the chunks now: the caller holds the parameters still). Collective over the trainer ranks; jobs queued before
        it run first (against the dead server, they fail) and are asked again by their owners."""
        self._thread.submit(lambda: None).result()  # what was queued has run (and failed on the dead server)
        self.transport.close()
        if self.service is not None:
            self.service.stop()
        self.epoch += 1
        self._start()
        self.sync(self.chunks, version, check)

    def call(self, fn, then=None) -> "ServerCall":
        """``then(fn())`` on the rollout thread (after what was asked before it), asked again on a new server if the
        server dies first: see :class:`ServerCall`."""
        return ServerCall(self, fn, then)

    def generate(self, prompts, sampling):
        """A batch (every trainer rank gets the same), waiting for requests queued before it."""
        return self.call(lambda: self.client.generate(prompts, sampling)).result()

    def sync(self, chunks, version: int, check: float | None = None) -> None:
        """Sends weights ``version`` to the server (after queued rollouts); returns once they are sent (``check``: the
        server verifies them with this tolerance, the periodic engine check: a failure leaves its engine refusing to
        generate, which the next rollout reports). A server found dead is replaced and given ``version``."""
        def update():
            self.client.update_weights(version, check)
            self.sender.sync(chunks, version, check=check is not None)

        ServerCall(self, update, version=version).result()
        self.version = version

    def recover(self, failed: "ServerJobFailed | None", version: int) -> None:
        """After a request failed on some trainer rank (``failed`` on those, None on the others): replaces a dead
        server and gives it ``version``, or raises on every trainer rank when the server lives (the request's own
        error) or has died ``rollout.max_restarts`` times. Collective over the trainer ranks."""
        ended = self.died(lost=failed is not None and failed.lost)
        error = None if failed is None else failed.error
        limit = self.config.rollout.max_restarts
        if ended is not None and self.epoch >= limit:
            raise RuntimeError(f"the rollout server died ({ended}) after {self.epoch} restarts: rollout.max_restarts="
                               f"{limit} are spent; its log: {self._log_path.parent}") from error
        if ended is None:
            agree(error, self._control)  # raises on every rank (a rank failed): the request's error, named
            raise AssertionError("agree returned after a rank's request failed")
        if self.service is not None:  # rank 0, which started it
            logger.warning("the rollout server died (%s); starting a new one with the student's weights version %d "
                           "(restart %d of rollout.max_restarts=%d); requests it had not answered are asked again",
                           ended, version, self.epoch + 1, limit)
        self.restart(version, self._tolerance)

    def close(self) -> None:
        """Stops the server (collective over the trainer ranks), the thread and the transport."""
        try:
            self.submit(self.client.close).result(timeout=300)
        except ServerJobFailed as failed:  # a server that died after the last request has nothing left to stop
            if not failed.lost:
                raise failed.error from failed
            logger.warning("the rollout server could not be told to stop (%s): it had died", failed.error)
        finally:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self.transport.close()
            if self.service is not None:
                self.service.stop()


class ServerJobFailed(Exception):
    """A job of the rollout thread failed (``error``) on the server of ``epoch``; ``lost``: its connection to the
    server failed (the server may be dead), else the server answered with an error or the job's own part failed."""

    def __init__(self, epoch: int, error: BaseException, lost: bool):
        super().__init__(f"{type(error).__name__}: {error}")
        self.epoch, self.error, self.lost = epoch, error, lost


class ServerCall:
    """A request to the rollout server that outlives the server (NeMo-RL's fault-tolerant generation): ``fn`` runs on
    the rollout thread now; :meth:`result` (on the main thread of every trainer rank, in the same order) returns its
    value, or, when it failed on any rank because the server died, has the dead server replaced with the student's
    current weights (:meth:`RemoteRollout.recover`: the trainer holds them still while it waits here) and asks
    ``fn`` again, until it is answered. Nothing the dead server sampled reached the trainer, so nothing is trained
    twice or lost. A call that failed on a server already replaced is asked again at once.

    Args:
        remote: the rollout server's owner.
        fn: the request (``client.generate``); then: what uses its answer (this rank's teacher and reward requests
            for its share), or None.
        version: an update's version, which a new server is given instead of the one it held (an update found
            done: not asked again).
    """

    def __init__(self, remote: RemoteRollout, fn, then=None, version: int | None = None):
        self._remote, self._fn, self._then, self._version = remote, fn, then, version
        self._future = remote.submit(fn, then)

    def result(self):
        import torch
        import torch.distributed as dist

        remote = self._remote
        while True:
            failed = None
            try:
                _, value = self._future.result()
            except ServerJobFailed as caught:
                failed, value = caught, None
            # [failed here, failed on the current server]: the same decision on every trainer rank
            flags = torch.tensor([int(failed is not None), int(failed is not None and failed.epoch == remote.epoch)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=remote._control)
            if not flags[0]:
                return value
            if flags[1]:
                remote.recover(failed, remote.version if self._version is None else self._version)
                if self._version is not None:  # the new server was given this update
                    return None
            self._future = remote.submit(self._fn, self._then)
