"""Teacher replicas: N worker processes behind one proxy (``serve --num-workers N`` of the teacher's command
line, :data:`TEACHER_CLI`).

Each replica is its own process (``python -m megatron_gkd.teacher.service.cli worker``), not a thread of the serving
process: a replica that crashes (a segfault, the OOM killer, a CUDA error that poisons its context) takes only
itself down, and one that is slow in Python code (decoding, encoding a large result) holds only its
own interpreter lock. The proxy gives each registered worker one request at a time from its queue, so
the others keep taking requests, and reports a dead worker's in-flight request to its client, which
retries it on a live one. The cost is one model copy per replica, which data-parallel replicas need
anyway.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from megatron_gkd.child_process import PARENT_PID_ENV

logger = logging.getLogger(__name__)

_POLL_S = 0.2


TEACHER_CLI = "megatron_gkd.teacher.service.cli"
"""The teacher service's command line, run with ``python -m`` (``launch/teacher_server.py`` calls it)."""


def backend_arg_flags(backend_args: dict) -> list[str]:
    """``backend_args`` as :data:`TEACHER_CLI`'s ``--backend-arg key=value`` flags: strings as they are, other
    values as JSON (the command line parses a value as JSON when it parses, else keeps the string)."""
    flags = []
    for key, value in backend_args.items():
        flags += ["--backend-arg", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return flags


class WorkerProcesses:
    """Starts ``num_workers`` worker processes connected to ``connect`` and watches them.

    Args:
        num_workers: replicas to start.
        connect: the proxy's worker address.
        worker_args: the worker options (backend, model, limits, delay ...), without role and address.
    """

    def __init__(self, num_workers: int, connect: str, worker_args: list[str]):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        command = [sys.executable, "-m", TEACHER_CLI, "worker", "--connect", connect, "--exit-with-parent",
                   *worker_args]
        # Output goes where this process's goes (the service log); the secret travels in the environment, and this
        # process's pid, so that a replica notices a death of this process before it imported anything.
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        self.processes = [subprocess.Popen(command, env=env) for _ in range(num_workers)]
        self._reported: set[int] = set()
        logger.info("started %d teacher worker processes (pids %s)", num_workers,
                    ", ".join(str(p.pid) for p in self.processes))

    @property
    def num_alive(self) -> int:
        return sum(process.poll() is None for process in self.processes)

    def wait_registered(self, registered, stop: threading.Event, timeout_s: float | None = None) -> None:
        """Waits until ``registered()`` (the proxy's count) reaches the number of workers, or ``stop``.

        Raises:
            RuntimeError: a worker exited first, or ``timeout_s`` passed.
        """
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while registered() < len(self.processes) and not stop.is_set():
            for index, process in enumerate(self.processes):
                if process.poll() is not None:
                    raise RuntimeError(f"teacher worker {index} (pid {process.pid}) exited with code "
                                       f"{process.returncode} before it registered; see its output above")
            if end is not None and time.monotonic() > end:
                raise RuntimeError(f"{registered()} of {len(self.processes)} teacher workers registered "
                                   f"within {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def watch(self, stop: threading.Event) -> None:
        """Until ``stop`` is set: logs each worker that exits; returns early when none is left.

        A dead replica is not restarted: the others serve on, and its cause (often the model or the
        machine) is what an operator must see in the log.
        """
        while not stop.wait(_POLL_S * 5):
            for index, process in enumerate(self.processes):
                if process.poll() is not None and index not in self._reported:
                    self._reported.add(index)
                    logger.warning("teacher worker %d (pid %d) exited with code %s; %d of %d workers serve on",
                                   index, process.pid, process.returncode, self.num_alive, len(self.processes))
            if not self.num_alive:
                logger.error("every teacher worker has exited; stopping the service")
                return

    def close(self) -> None:
        """SIGTERM to every worker, SIGKILL to those still running after 30 s."""
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
