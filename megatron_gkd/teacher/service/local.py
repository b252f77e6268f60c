"""A teacher service the run starts itself: ``python -m megatron_gkd.teacher.service.cli serve`` on loopback, as a child
(:class:`~megatron_gkd.child_process.ServiceProcess`: its own process group, a log file in the run
directory, stopped at exit and when the trainer dies), and :class:`ServiceKeeper`, which replaces one that dies."""

from __future__ import annotations

import logging
import secrets
import sys
import threading

from megatron_gkd.child_process import ServiceProcess
from megatron_gkd.teacher.service.replicas import TEACHER_CLI, backend_arg_flags

logger = logging.getLogger(__name__)
_POLL_S = 1.0


class TeacherService(ServiceProcess):
    """Starts one teacher service (proxy + ``serve.num_workers`` workers) on loopback; :meth:`wait_ready`
    gives its address once every worker has registered.

    Args:
        serve: the ``teacher.serve`` section (model, backend, backend options, delay, workers).
        log_path: where the service's output goes.
        secret: the HMAC secret clients and service share (a fresh random one by default).
    """

    def __init__(self, serve, log_path, secret: str | None = None, frontend: str = "tcp://127.0.0.1:0"):
        self.serve, self.secret = serve, secret or secrets.token_hex(32)
        args = [sys.executable, "-m", TEACHER_CLI, "serve", "--exit-with-parent", "--frontend", frontend,
                "--backend", serve.backend, "--model", str(serve.model)]
        args += backend_arg_flags(serve.backend_args)
        if serve.delay_s:
            args += ["--delay-s", str(serve.delay_s)]
        if serve.num_workers > 1:
            args += ["--num-workers", str(serve.num_workers)]
        super().__init__(f"teacher service ({serve.backend} backend, {serve.model})", args, log_path,
                         env={"MEGATRON_GKD_TEACHER_SECRET": self.secret}, ready=r"READY frontend=(\S+)")


class ServiceKeeper:
    """Replaces a teacher service of the run that dies (killed, out of memory, its last replica gone) by a new one on
    the same address with the same secret, up to ``teacher.serve.max_restarts`` times each: the clients' retries
    (``teacher.attempt_timeout_s``, within ``teacher.deadline_s``) reach the new one, so the step that was waiting
    trains on a complete answer, late rather than never. A thread of the rank that started the services.

    Args:
        services: ``{name: (service, address)}``, each service with the frontend address it is ready on.
    """

    def __init__(self, services: dict):
        self._services = dict(services)
        self._logs = {name: service.log_path for name, (service, _) in services.items()}
        self.restarts = {name: 0 for name in services}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="teacher-service-keeper", daemon=True)
        self._thread.start()

    def service(self, name: str) -> TeacherService:
        return self._services[name][0]

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            for name, (service, address) in list(self._services.items()):
                if service.process.poll() is None or self._stop.is_set():
                    continue
                limit = service.serve.max_restarts
                if self.restarts[name] >= limit:
                    logger.error("the %s exited with code %s and teacher.serve.max_restarts=%d are spent: its "
                                 "requests fail after teacher.deadline_s", service.name, service.process.returncode, limit)
                    del self._services[name]
                    continue
                self.restarts[name] += 1
                logger.warning("the %s exited with code %s; starting a new one on %s (restart %d of "
                               "teacher.serve.max_restarts=%d); the clients retry their requests on it", service.name,
                               service.process.returncode, address, self.restarts[name], limit)
                log = self._logs[name].with_suffix(f".{self.restarts[name]}.log")
                try:
                    replacement = TeacherService(service.serve, log, secret=service.secret, frontend=address)
                    self._services[name] = (replacement, address)
                    replacement.wait_ready(service.serve.startup_timeout_s)
                except Exception:  # noqa: BLE001 - logged; the clients' deadline reports it to the run
                    logger.exception("the new %s did not start", service.name)

    def stop(self) -> None:
        """Stops watching and stops the services now in use (a replacement still starting included)."""
        self._stop.set()
        error = None
        for service, _ in list(self._services.values()):
            try:
                service.stop()
            except Exception as caught:  # noqa: BLE001 - stop the others too
                error = error or caught
        self._thread.join()
        if error is not None:
            raise error
