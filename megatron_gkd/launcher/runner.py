"""Runs a :class:`~megatron_gkd.launcher.plan.JobPlan`: the teacher's steps in order (Ray gate, health
wait), the student, teardown, and the requeue after a preemption."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from megatron_gkd.launcher.plan import JobPlan
from megatron_gkd.launcher.processes import Executor, Running
from megatron_gkd.launcher.teacher import RayGate
from megatron_gkd.teacher.clients import RetryPolicy
from megatron_gkd.teacher.clients.zmq_client import ZmqTeacherClient, load_secret
from megatron_gkd.teacher.protocol.types import TeacherError

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Stopped(Exception):
    """A preemption signal arrived while the job was still starting."""


def write_secret(path) -> None:
    """A random shared secret, readable by its owner only (kept across requeues of the same job)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(os.urandom(32).hex())


def wait_for_teacher(address: str, secret_file, timeout_s: float, check) -> dict:
    """Asks the service at ``address`` for its INFO until a worker answers; returns the info.

    ``check()`` runs between attempts and raises to give up early (a teacher step died, a signal).

    Raises:
        TimeoutError: no answer within ``timeout_s``.
    """
    import dataclasses

    retry = RetryPolicy(attempt_timeout_s=5.0, deadline_s=10.0, max_attempts=1)
    client = ZmqTeacherClient(address, secret=load_secret(str(secret_file)), retry=retry)
    # Unanswered attempts are expected while the model loads; the client would warn about each one.
    client_logger = logging.getLogger(ZmqTeacherClient.__module__)
    level = client_logger.level
    client_logger.setLevel(logging.ERROR)
    logger.info("waiting for the teacher at %s (at most %.0f s)", address, timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            check()
            try:
                return dataclasses.asdict(client.info())
            except TeacherError as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the teacher at {address} did not answer within {timeout_s:.0f} s "
                                       f"({error}); see its log") from None
            time.sleep(1.0)
    finally:
        client_logger.setLevel(level)
        client.close()


class Job:
    """One run of a plan on an executor. :meth:`run` returns the job's exit status."""

    def __init__(self, plan: JobPlan, executor: Executor):
        self.plan, self.executor = plan, executor
        self.running: list[Running] = []
        self.signal: int | None = None

    # ---------------------------------------------------------------------------------------- signals
    def _on_signal(self, signum, frame) -> None:
        """SIGUSR1 (the warning before the time limit, ``--signal=B:USR1@T``): forwarded to the trainer as
        SIGUSR1, and the job requeues once the trainer has checkpointed. SIGTERM: Slurm sends it to every
        process of the job itself (cancel, time limit, preemption), so it is forwarded only on one
        machine; the job does not requeue (Slurm cancels or requeues it on its own)."""
        self.signal = signum
        if signum == signal.SIGTERM and self.plan.allocation.scheduler == "slurm":
            logger.warning("SIGTERM: Slurm signals the trainer itself; waiting for it to checkpoint and stop")
            return
        logger.warning("%s: forwarding SIGUSR1 to the trainer", signal.Signals(signum).name)
        for step in self.running:
            if step.step.signal_target:
                step.send_signal(signal.SIGUSR1)

    def _check(self) -> None:
        if self.signal is not None:
            raise Stopped()
        for step in self.running:
            code = step.poll()
            if code is not None:
                raise RuntimeError(f"step {step.name} exited with code {code} while the job was starting; "
                                   f"see {self.executor.log_dir / (step.name + '.log')}")

    # ------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in PREEMPTION_SIGNALS}
        try:
            code = self._run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return code

    def _run(self) -> int:
        plan, code = self.plan, 0
        try:
            if plan.teacher is not None:
                self._start_teacher()
            if plan.student is not None:
                code = self._wait(self.executor.start(plan.student))
            else:
                code = self._serve()
        except Stopped:
            logger.warning("stopped by a signal while starting")
        finally:
            self._stop_all()
        if self.signal == signal.SIGUSR1 and code == 0 and plan.student is not None:
            self._requeue()
        return code

    def _start_teacher(self) -> None:
        teacher, options = self.plan.teacher, self.plan.options
        write_secret(options.secret_file)
        for action in teacher.actions:
            self._check()
            if isinstance(action, RayGate):
                self._ray_gate(action)
            else:
                self.running.append(self.executor.start(action))
        info = wait_for_teacher(teacher.address, options.secret_file, options.health_timeout_s, self._check)
        tmp = options.address_file.with_suffix(".tmp")
        tmp.write_text(teacher.address + "\n")
        tmp.replace(options.address_file)
        # A line for scripts that wait on the job's output, beside the address file.
        sys.stdout.write(f"TEACHER READY {teacher.address} ({info.get('backend', teacher.backend)})\n")
        sys.stdout.flush()

    def _ray_gate(self, gate: RayGate) -> None:
        process = subprocess.Popen(gate.command())
        while process.poll() is None:
            try:
                self._check()
            except BaseException:
                process.terminate()
                process.wait()
                raise
            time.sleep(1.0)
        if process.returncode:
            raise RuntimeError(f"the Ray cluster is not ready for the teacher (exit {process.returncode})")

    def _wait(self, student: Running) -> int:
        self.running.append(student)
        while (code := student.poll()) is None:
            for step in self.running:
                if step is not student and step.poll() is not None:
                    logger.error("teacher step %s exited with code %s; stopping the student", step.name, step.poll())
                    student.stop()
                    return 1
            time.sleep(1.0)
        logger.info("student exited with code %d", code)
        return code

    def _serve(self) -> int:
        while self.signal is None:
            for step in self.running:
                if step.poll() is not None:
                    logger.error("teacher step %s exited with code %s", step.name, step.poll())
                    return 1
            time.sleep(1.0)
        logger.info("teacher service stopping after %s", signal.Signals(self.signal).name)
        return 0

    def _stop_all(self) -> None:
        for step in reversed(self.running):  # the service before the Ray nodes under it
            if step.poll() is None:
                step.stop()
        self.running.clear()

    def _requeue(self) -> None:
        job_id = self.plan.allocation.job_id
        if not self.plan.options.requeue or self.plan.allocation.scheduler != "slurm" or not job_id:
            logger.warning("preempted; rerun the same command to resume from the checkpoint")
            return
        logger.warning("preempted: requeueing job %s; it resumes from the checkpoint", job_id)
        subprocess.run(["scontrol", "requeue", job_id], check=False)
