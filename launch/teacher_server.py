"""Teacher service: a proxy, a worker, or both in one process.

    teacher_server.py serve  --frontend tcp://127.0.0.1:5555 --backend hf --model DIR   # proxy + 1 worker
    teacher_server.py proxy  --frontend tcp://0.0.0.0:5555 --workers tcp://0.0.0.0:5556 --secret-file F
    teacher_server.py worker --connect tcp://proxy-host:5556 --backend vllm --model DIR --secret-file F
    torchrun --nproc_per_node 2 teacher_server.py serve --backend megatron --model DIR \
        --backend-arg tensor_model_parallel_size=2          # rank 0 serves, the other ranks follow

Backend options are given as ``--backend-arg key=value`` (values parsed as JSON when they parse, e.g.
``tensor_parallel_size=8``); ``--backend-module M`` imports a module that registers more backends.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import threading

from megatron_gkd.child_process import exit_with_parent
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.teacher import wire
from megatron_gkd.teacher.backends import DelayedBackend, backend_names, build_backend
from megatron_gkd.teacher.clients.zmq_client import load_secret
from megatron_gkd.teacher.server import Proxy, Worker, WorkLimits

logger = logging.getLogger(__name__)


def _backend_kwargs(pairs: list[str]) -> dict:
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--backend-arg {pair!r} must look like key=value")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="megatron-gkd teacher service")
    parser.add_argument("role", choices=("serve", "proxy", "worker"))
    parser.add_argument("--frontend", default="tcp://127.0.0.1:5555", help="address clients connect to")
    parser.add_argument("--workers", default="tcp://127.0.0.1:5556",
                        help="address workers connect to (proxy role)")
    parser.add_argument("--connect", default="tcp://127.0.0.1:5556",
                        help="the proxy's worker address (worker role)")
    parser.add_argument("--backend", default="hf", help=f"one of {backend_names()}")
    parser.add_argument("--model", help="teacher checkpoint (serve/worker roles)")
    parser.add_argument("--backend-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--backend-module", action="append", default=[],
                        help="module imported first (registers extra backends)")
    parser.add_argument("--secret-file", help="shared secret for HMAC (else $MEGATRON_GKD_TEACHER_SECRET)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow non-loopback addresses without a secret (logs a warning)")
    parser.add_argument("--max-message-mb", type=int, default=512)
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the process that started this one dies, even by SIGKILL (Linux)")
    parser.add_argument("--delay-s", type=float, default=0.0,
                        help="latency added to every request (benchmarks of a slow teacher; default 0)")
    parser.add_argument("--max-request-tokens", type=int, default=WorkLimits().max_request_tokens,
                        help="tokens of all sequences of one request a worker accepts")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging("INFO")
    secret = load_secret(args.secret_file)
    limits = wire.Limits(max_message_bytes=args.max_message_mb * 2**20)
    for module in args.backend_module:
        importlib.import_module(module)
    stop = threading.Event()
    proxy = worker = backend = None
    try:
        if args.role in ("serve", "worker"):
            if not args.model:
                raise ValueError("--model is required for the serve and worker roles")
            backend = build_backend(args.backend, model=args.model, **_backend_kwargs(args.backend_arg))
            if args.delay_s > 0:
                backend = DelayedBackend(backend, args.delay_s)
            if not backend.is_leader:
                # An extra rank of a multi-process backend (megatron under torchrun): it runs its share
                # of every forward that rank 0 receives, and opens no socket.
                backend.follow()
                return
        # Installed after the followers branched off: they end with the leader or by the default
        # SIGTERM that torchrun forwards.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        if args.exit_with_parent:
            exit_with_parent()
        if args.role in ("serve", "proxy"):
            workers = None if args.role == "serve" else args.workers  # serve: a private IPC socket
            proxy = Proxy(args.frontend, workers, secret, args.insecure, limits).start()
        if backend is not None:
            connect = proxy.backend_address if proxy else args.connect
            worker = Worker(connect, backend, secret, args.insecure, limits,
                            WorkLimits(max_request_tokens=args.max_request_tokens)).start()
        # Scripts and tests read this line; it also tells the ports picked for ":0" addresses.
        if proxy is not None:
            print(f"READY frontend={proxy.frontend_address} workers={proxy.backend_address}", flush=True)
        else:
            print(f"READY worker connected to {args.connect}", flush=True)
        stop.wait()
    finally:
        for part in (worker, backend, proxy):  # stop taking requests before releasing the model
            if part is not None:
                part.close()


if __name__ == "__main__":
    main()
