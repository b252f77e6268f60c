"""Start and stop teacher processes for e2e tests; every process is killed at the end."""

import os
import pathlib
import select
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[3]


def spawn(args: list[str], log_path: pathlib.Path, env: dict | None = None) -> subprocess.Popen:
    """Runs ``python args`` from the repo root; stdout is a pipe, stderr goes to ``log_path``."""
    environment = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, env=environment,
                                stdout=subprocess.PIPE, stderr=log, text=True)


def start(args: list[str], ready: str, timeout_s: float, log_path: pathlib.Path,
          env: dict | None = None) -> subprocess.Popen:
    """Spawns and waits for a stdout line containing ``ready`` (kept as ``process.ready_line``)."""
    process = spawn(args, log_path, env)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {process.returncode}; see {log_path}")
        if select.select([process.stdout], [], [], 0.5)[0]:
            line = process.stdout.readline()
            if ready in line:
                process.ready_line = line
                return process
    stop(process, kill=True)
    raise RuntimeError(f"{args[0]} not ready after {timeout_s} s; see {log_path}")


def stop(process: subprocess.Popen, kill: bool = False) -> None:
    """Terminates (or kills) ``process`` and waits for it."""
    if process.poll() is None:
        process.kill() if kill else process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
