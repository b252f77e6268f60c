"""Teacher service: a proxy, a worker, or both in one process. Run as ``launch/teacher_server.py`` or
``python -m megatron_gkd.teacher.service.cli``:

    teacher_server.py serve  --frontend tcp://127.0.0.1:5555 --backend hf --model DIR   # proxy + 1 worker
    teacher_server.py serve  --backend hf --model DIR --num-workers 2   # proxy + 2 worker processes
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
import os
import signal
import threading

from megatron_gkd import platform
from megatron_gkd.child_process import exit_with_parent
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.teacher.backends import DelayedBackend, backend_names, build_backend
from megatron_gkd.teacher.clients.zmq_client import load_secret
from megatron_gkd.teacher.protocol import wire
from megatron_gkd.teacher.service.replicas import WorkerProcesses
from megatron_gkd.teacher.service.server import Proxy, Worker, WorkLimits

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
                        help="tokens of all sequences of one request a worker accepts (a generate request "
                             "counts each response as its prompt plus max_tokens)")
    parser.add_argument("--max-generate-prompts", type=int, default=WorkLimits().max_generate_prompts,
                        help="prompts of one generate request a worker accepts")
    parser.add_argument("--max-new-tokens", type=int, default=WorkLimits().max_new_tokens,
                        help="the largest max_tokens (longest response) a generate request may ask for")
    parser.add_argument("--max-generate-mb", type=int, default=WorkLimits().max_generate_bytes >> 20,
                        help="host memory one generate request may hold on a worker, as estimated from its "
                             "responses and max_tokens (MiB)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="serve role: worker replicas behind the proxy; 1 scores in this process, more "
                             "start that many worker processes (each loads the model)")
    return parser


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The options a worker process of ``serve --num-workers N`` needs (all but role and address)."""
    options = ["--backend", args.backend, "--model", args.model, "--max-message-mb", str(args.max_message_mb),
               "--delay-s", str(args.delay_s), "--max-request-tokens", str(args.max_request_tokens),
               "--max-generate-prompts", str(args.max_generate_prompts), "--max-new-tokens", str(args.max_new_tokens),
               "--max-generate-mb", str(args.max_generate_mb)]
    options += [item for pair in args.backend_arg for item in ("--backend-arg", pair)]
    options += [item for module in args.backend_module for item in ("--backend-module", module)]
    if args.secret_file:
        options += ["--secret-file", args.secret_file]
    return options + (["--insecure"] if args.insecure else [])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    platform.limit_malloc_arenas()  # before any thread: the proxy's, the worker's, the backend's
    if args.exit_with_parent:
        # First: a replica of `serve` still loading its model (a minute for a large one, under load) stops when
        # serve dies, by the default SIGTERM; the handler installed below takes over once the model is loaded.
        exit_with_parent()
    setup_logging("INFO")
    secret = load_secret(args.secret_file)
    limits = wire.Limits(max_message_bytes=args.max_message_mb * 2**20)
    for module in args.backend_module:
        importlib.import_module(module)
    if args.num_workers < 1 or (args.num_workers > 1 and args.role != "serve"):
        raise ValueError(f"--num-workers={args.num_workers} must be >= 1, and more than 1 only with the serve role")
    if args.num_workers > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--num-workers > 1 under torchrun: start one torchrun worker role per replica "
                         "(teacher_server.py worker --connect ...) behind a proxy instead")
    stop = threading.Event()
    proxy = worker = backend = replicas = None
    try:
        if args.role in ("serve", "worker") and not args.model:
            raise ValueError("--model is required for the serve and worker roles")
        if args.role == "worker" or (args.role == "serve" and args.num_workers == 1):
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
        if args.role in ("serve", "proxy"):
            workers = None if args.role == "serve" else args.workers  # serve: a private IPC socket
            proxy = Proxy(args.frontend, workers, secret, args.insecure, limits).start()
        if backend is not None:
            connect = proxy.backend_address if proxy else args.connect
            worker = Worker(connect, backend, secret, args.insecure, limits,
                            WorkLimits(max_request_tokens=args.max_request_tokens,
                                       max_generate_prompts=args.max_generate_prompts,
                                       max_new_tokens=args.max_new_tokens,
                                       max_generate_bytes=args.max_generate_mb << 20)).start()
        elif args.role == "serve":
            replicas = WorkerProcesses(args.num_workers, proxy.backend_address, _worker_args(args))
            replicas.wait_registered(lambda: proxy.num_workers, stop)
        # Scripts and tests read this line; it also tells the ports picked for ":0" addresses.
        if proxy is not None:
            print(f"READY frontend={proxy.frontend_address} workers={proxy.backend_address}", flush=True)
        else:
            print(f"READY worker connected to {args.connect}", flush=True)
        if replicas is None:
            while not stop.wait(1.0):
                if worker is not None and worker.refused:
                    raise SystemExit(f"the teacher proxy refused this worker: {worker.refused}")
        else:
            replicas.watch(stop)
            if not stop.is_set():
                raise SystemExit("every teacher worker has exited")
    finally:
        # Scripts read this line (benchmarks/trl_compare.py: the teacher process's memory beside the ranks'); before
        # the parts close, as closing may fail (a megatron leader's last broadcast to followers torchrun stopped first).
        logger.info("teacher %s stopped: peak RSS %.2f GiB", args.role, platform.peak_rss_gib())
        for part in (worker, replicas, backend, proxy):  # stop taking requests before releasing the model
            if part is not None:
                part.close()


if __name__ == "__main__":
    main()
