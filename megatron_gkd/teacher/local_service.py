"""A teacher service the run starts itself: ``python -m megatron_gkd.teacher.cli serve`` on loopback, as a child
(:class:`~megatron_gkd.child_process.ServiceProcess`: its own process group, a log file in the run
directory, stopped at exit and when the trainer dies)."""

from __future__ import annotations

import secrets
import sys

from megatron_gkd.child_process import ServiceProcess
from megatron_gkd.teacher.replicas import TEACHER_CLI, backend_arg_flags


class TeacherService(ServiceProcess):
    """Starts one teacher service (proxy + ``serve.num_workers`` workers) on loopback; :meth:`wait_ready`
    gives its address once every worker has registered.

    Args:
        serve: the ``teacher.serve`` section (model, backend, backend options, delay, workers).
        log_path: where the service's output goes.
        secret: the HMAC secret clients and service share (a fresh random one by default).
    """

    def __init__(self, serve, log_path, secret: str | None = None):
        self.secret = secret or secrets.token_hex(32)
        args = [sys.executable, "-m", TEACHER_CLI, "serve", "--exit-with-parent", "--frontend", "tcp://127.0.0.1:0",
                "--backend", serve.backend, "--model", str(serve.model)]
        args += backend_arg_flags(serve.backend_args)
        if serve.delay_s:
            args += ["--delay-s", str(serve.delay_s)]
        if serve.num_workers > 1:
            args += ["--num-workers", str(serve.num_workers)]
        super().__init__(f"teacher service ({serve.backend} backend, {serve.model})", args, log_path,
                         env={"MEGATRON_GKD_TEACHER_SECRET": self.secret}, ready=r"READY frontend=(\S+)")
