"""The processes of ``serve --num-workers N`` end with it, even when it is killed while they load their model."""

import os
import pathlib
import signal
import subprocess
import sys
import time

from megatron_gkd.child_process import free_port
from megatron_gkd.teacher.service.replicas import TEACHER_CLI

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_replicas_still_loading_their_model_stop_when_serve_is_killed(tmp_path):
    """Issue #48: replicas of a killed ``serve`` were alive 15 s later under load: a replica noticed its parent's
    death only once its model had loaded."""
    pid_file = tmp_path / "loading"
    env = {**os.environ, "LOADING_BACKEND_PID_FILE": str(pid_file), "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", TEACHER_CLI, "serve", "--model", str(tmp_path), "--num-workers",
                              "2", "--frontend", f"tcp://127.0.0.1:{free_port()}", "--backend-module",
                              "tests.unit.teacher.loading_backend", "--backend", "slow_loading"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and len(pid_file.read_text().split()) == 2):
            assert time.monotonic() < deadline and serve.poll() is None, "the replicas did not start loading"
            time.sleep(0.1)
    finally:
        serve.kill()
        serve.wait()
    replicas = [int(pid) for pid in pid_file.read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in replicas) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in replicas if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"replicas {alive} outlived the killed serve process"


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
