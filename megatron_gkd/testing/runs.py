"""Run the real entry point under torchrun on the tiny assets, and read what a run leaves behind (the
trainer's e2e tests and benchmarks).

Every run is its own process tree (torchrun, its ranks, the teacher service the run starts), in its own
session, with its output in a log file; :func:`stop` kills the whole tree.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from megatron_gkd.launcher.commands import TRAINER_CLI
from megatron_gkd.parallel.state import RESTART_ENV

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "cpu_tiny.yaml"
# 20 deterministic sync steps with a checkpoint after each: the reference run of the resume tests.
SYNC_RUN = ["trainer.scheduler=sync", "trainer.num_steps=20", "trainer.deterministic=true", "eval.interval=10",
            "checkpoint.save_interval=1", "checkpoint.keep_last_n=30", "optim.lr_warmup_steps=0", "optim.lr=2e-3"]
# 3 off-policy steps on fixed data, no eval or checkpoints: the reference run of the layout-invariance tests.
OFF_POLICY_3_STEPS = ["trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
                      "trainer.num_steps=3", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
                      "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0",
                      "optim.lr=2e-3"]

# A task of skewed response lengths on the tiny student: at temperature 0.5 with 32 ids that stop a response, most
# responses are short (median about 12 tokens) and a few run to rollout.max_tokens (partial rollouts' e2e test and
# benchmarks/partial_rollouts.py).
SKEWED_LENGTHS = ["rollout.temperature=0.5", f"rollout.stop_token_ids=[{','.join(str(i) for i in range(100, 132))}]"]


def asset_overrides(assets: pathlib.Path) -> list[str]:
    """Point the tiny preset at assets built by ``megatron_gkd.recipes.tiny.build_assets``."""
    return [f"student.checkpoint={assets / 'student'}", f"teacher.serve.model={assets / 'teacher'}",
            f"data.train_path={assets / 'train.jsonl'}", f"data.eval_path={assets / 'eval.jsonl'}"]


def command(out: pathlib.Path, overrides: list[str], nproc: int = 2, config: pathlib.Path = CONFIG,
            module: str = TRAINER_CLI, max_restarts: int = 0) -> list[str]:
    """The torchrun command of a run; ``module``: the trainer's CLI, or a test's module that wraps it (run from the
    repository root, e.g. ``tests.e2e.trainer.stale_engine``); ``max_restarts``: torchrun's restarts of the ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            f"--max-restarts={max_restarts}", "-m", module, "--config", str(config), f"trainer.output_dir={out}",
            "logging.progress_bar=false", *overrides]


def start(out: pathlib.Path, overrides: list[str], nproc: int = 2, log_name: str = "run.log", env: dict | None = None,
          config: pathlib.Path = CONFIG, module: str = TRAINER_CLI, max_restarts: int = 0):
    """Starts a run of ``config``; its output goes to ``out/../<out name>-<log_name>``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}-{log_name}"
    # Restarts need torchrun's environment to give every attempt its own store, as the launcher's does.
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(RESTART_ENV if max_restarts else {}), **(env or {})}
    environment.pop("PYTEST_CURRENT_TEST", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command(out, overrides, nproc, config, module, max_restarts), cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT, env=environment, start_new_session=True, text=True)
    process.log_path = log_path
    return process


def wait(process, timeout_s: float = 900) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(process, signal.SIGKILL)
        raise AssertionError(f"run did not finish within {timeout_s} s; log: {tail(process)}") from None


def run(out: pathlib.Path, overrides: list[str], nproc: int = 2, timeout_s: float = 900, log_name: str = "run.log",
        config: pathlib.Path = CONFIG, env: dict | None = None, module: str = TRAINER_CLI, max_restarts: int = 0):
    """Runs to the end; returns ``(exit code, log text)``."""
    process = start(out, overrides, nproc, log_name, env=env, config=config, module=module, max_restarts=max_restarts)
    code = wait(process, timeout_s)
    return code, process.log_path.read_text(errors="replace")


def stop(process, signum=signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def tail(process, chars: int = 4000) -> str:
    return process.log_path.read_text(errors="replace")[-chars:]


def metrics(out: pathlib.Path) -> list[dict]:
    """The records of ``metrics.jsonl``: step records (with ``train/loss``) and eval records."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def steps(out: pathlib.Path) -> list[dict]:
    return [record for record in metrics(out) if "train/loss" in record]


def wait_for_steps(out: pathlib.Path, count: int, process, timeout_s: float = 600) -> None:
    end = time.monotonic() + timeout_s
    while len(steps(out)) < count:
        assert process.poll() is None, f"run ended early: {tail(process)}"
        assert time.monotonic() < end, f"no {count} steps after {timeout_s} s: {tail(process)}"
        time.sleep(0.2)


def wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def worker_pids(out: pathlib.Path) -> list[int]:
    """The trainer ranks of the run writing to ``out`` (not torchrun itself)."""
    return [int(pid) for pid, cmdline in _processes() if TRAINER_CLI in cmdline
            and f"trainer.output_dir={out}" in cmdline and "torch.distributed.run" not in cmdline]


def _processes():
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                yield proc.name, (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue


def leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (e.g. a run directory)."""
    return [cmdline for _, cmdline in _processes() if marker in cmdline]
