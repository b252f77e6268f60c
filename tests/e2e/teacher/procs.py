"""Start and stop teacher processes for e2e tests; every process (and its children) is killed at the end.

Output goes to a log file, never to an unread pipe (a full pipe would block the server), and readiness
is read from that file. Each process leads its own session so that stopping it also stops the
children it spawned (vLLM's OpenAI server runs its engine in a child process).
"""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[3]


def spawn(args: list[str], log_path: pathlib.Path, env: dict | None = None) -> subprocess.Popen:
    """Runs ``python args`` from the repo root with stdout and stderr in ``log_path``."""
    environment = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, *args], cwd=REPO, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    process.log_path = log_path
    return process


def start(args: list[str], ready: str, timeout_s: float, log_path: pathlib.Path,
          env: dict | None = None) -> subprocess.Popen:
    """Spawns and waits for a log line containing ``ready`` (kept as ``process.ready_line``)."""
    process = spawn(args, log_path, env)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if ready in line]
        if lines:
            process.ready_line = lines[0]
            return process
        if process.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {process.returncode}; see {log_path}")
        time.sleep(0.2)
    stop(process, kill=True)
    raise RuntimeError(f"{args[0]} not ready after {timeout_s} s; see {log_path}")


def stop(process: subprocess.Popen, kill: bool = False) -> None:
    """Terminates (or kills) ``process`` and everything in its session, and waits for it."""
    try:
        os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    try:  # children that outlived their parent
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_secret(directory: pathlib.Path) -> tuple[pathlib.Path, bytes]:
    """(file, secret): a random shared secret in ``directory``, readable by its owner only."""
    secret, path = os.urandom(32).hex().encode(), directory / "secret"
    path.write_bytes(secret)
    path.chmod(0o600)  # servers refuse a secret others may read
    return path, secret


@contextlib.contextmanager
def proxy_and_workers(tmp_path: pathlib.Path):
    """Yields ``(proxy, start_worker)``: an in-process proxy on loopback and
    ``start_worker(name, model, delay_s) -> (process, marker_dir)``, which starts a worker process behind it
    (``delay_s``: the slow test backend holding each request that long and leaving a marker file per
    request; ``None``: the plain hf backend). Every worker is killed and the proxy closed at the end."""
    from megatron_gkd.teacher.service.server import Proxy

    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0").start()
    started = []

    def start_worker(name: str, model, delay_s: float | None = 0.0):
        marker_dir = tmp_path / name
        marker_dir.mkdir()
        args = ["launch/teacher_server.py", "worker", "--connect", proxy.backend_address, "--model", str(model)]
        if delay_s is not None:
            args += ["--backend-module", "tests.e2e.teacher.slow_backend", "--backend", "hf_slow",
                     "--backend-arg", f"marker_dir={marker_dir}", "--backend-arg", f"delay_s={delay_s}"]
        process = start(args, "READY worker connected", 180, tmp_path / f"{name}.log")
        started.append(process)
        return process, marker_dir

    try:
        yield proxy, start_worker
    finally:
        for process in started:
            stop(process, kill=True)
        proxy.close()


@contextlib.contextmanager
def service(directory: pathlib.Path, max_message_mb: int, max_request_tokens: int | None = None):
    """Yields a dict (frontend, workers, secret, teacher, proxy, worker): a teacher proxy process and
    one hf worker process behind it, on loopback, with a fresh secret; both are stopped at the end."""
    from megatron_gkd.testing.tiny_teacher import build_tiny_teacher

    teacher = build_tiny_teacher(directory / "teacher", num_layers=1)
    secret_file, secret = write_secret(directory)
    common = ["--secret-file", str(secret_file), "--max-message-mb", str(max_message_mb)]
    proxy = start(["launch/teacher_server.py", "proxy", "--frontend", "tcp://127.0.0.1:0",
                   "--workers", "tcp://127.0.0.1:0", *common], "READY frontend=", 120, directory / "proxy.log")
    frontend, workers = (part.split("=", 1)[1] for part in proxy.ready_line.split()[-2:])
    extra = [] if max_request_tokens is None else ["--max-request-tokens", str(max_request_tokens)]
    try:
        worker = start(["launch/teacher_server.py", "worker", "--connect", workers, "--model", str(teacher),
                        *extra, *common], "READY worker connected", 180, directory / "worker.log")
    except BaseException:
        stop(proxy)
        raise
    try:
        yield dict(frontend=frontend, workers=workers, secret=secret, teacher=teacher, proxy=proxy,
                   worker=worker)
    finally:
        stop(worker)
        stop(proxy)
