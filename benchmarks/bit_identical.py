"""Does a change leave training bit-identical? The demo's first steps from two versions of the code, metric by metric
(issue #47's acceptance: a redesign of the batch path changes no loss)::

    python benchmarks/bit_identical.py --base 00c988e                      # the demo's first 100 steps, base vs this tree
    python benchmarks/bit_identical.py --base 3c95c3b --variants kd rl mixture --steps 40

Each variant is the demo (``configs/demo_cpu.yaml``: TP=2, colocated vLLM, the teacher served on loopback, on 2 CPU
cores) with overrides (``VARIANTS``): ``kd`` as it is, ``rl`` the demo's GRPO + forward KL recipe
(``configs/demo_rl_kd.yaml``: rewards, 4 samples a prompt, the policy-gradient term), ``mixture`` GKD's mixture
(half the prompts answered by the records' own responses). Eval and checkpoints are off; the learning-rate schedule is
the demo's own (its 1000 steps): a run is stopped once it has logged ``--steps`` steps. ``--base`` runs in a git
worktree of that commit (``<out>/worktrees/<commit>``), the other side in this tree (or ``--head``, another commit).

Every logged metric but times, throughputs, memory and latencies is compared for equality at every step (losses,
gradient norms, teacher and student mass, rewards, policy-gradient statistics, the engine check, the mixture's
figures, the trained prompts). A seeded run repeats itself on one machine, not on another CPU: compare two versions
on the same machine, and run one side twice (``--base`` = ``--head``) to see that the comparison can pass.
Prints one line per variant and exits 1 if any metric differs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = {
    "kd": ("configs/demo_cpu.yaml", []),
    "rl": ("configs/demo_rl_kd.yaml", []),
    "mixture": ("configs/demo_cpu.yaml", ["sample_mix.lmbda=0.5", "sample_mix.per=prompt"]),
}
QUIET = ["eval.at_start=false", "eval.at_end=false", "eval.interval=100000", "checkpoint.save_interval=100000"]
UNTIMED = ("time/", "throughput/", "memory/", "teacher/latency", "weight_sync/")


def checkout(commit: str, out: pathlib.Path) -> pathlib.Path:
    """A worktree of ``commit`` whose ``megatron_gkd.models`` and ``megatron_gkd.parallel`` are its own (the editable
    install maps them to this tree's top-level ``models/`` and ``parallel/``; links inside its package win)."""
    path = out / "worktrees" / commit
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), commit], cwd=ROOT, check=True,
                       capture_output=True)
    for package in ("models", "parallel"):
        link = path / "megatron_gkd" / package
        if not link.exists():
            link.symlink_to(path / package, target_is_directory=True)
    return path


def run(tree: pathlib.Path, variant: str, steps: int, out: pathlib.Path, task: pathlib.Path) -> list[dict]:
    """The variant's first ``steps`` logged steps from the code in ``tree`` (its ``metrics.jsonl`` lines)."""
    config, overrides = VARIANTS[variant]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
               "launch/pretrain_gkd.py", "--config", config, f"data.train_path={task}/train.jsonl",
               f"data.eval_path={task}/eval.jsonl", f"trainer.output_dir={out}", *QUIET, *overrides]
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        while process.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                os.killpg(process.pid, signal.SIGTERM)  # the run checkpoints the step it is in and stops
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                break
            time.sleep(1)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if len(lines) < steps:
        raise SystemExit(f"{variant} from {tree}: {len(lines)} of {steps} steps logged; see {out.with_suffix('.log')}")
    return lines[:steps]


def differences(base: list[dict], head: list[dict]) -> tuple[int, dict[str, list[int]]]:
    """The metrics compared and, for each that differs, the steps where it does."""
    keys = [key for key in base[0] if not key.startswith(UNTIMED)]
    differ: dict[str, list[int]] = {}
    for a, b in zip(base, head, strict=True):
        for key in keys:
            if a.get(key) != b.get(key):
                differ.setdefault(key, []).append(a["step"])
    return len(keys), differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", default=None, help="another commit instead of this tree")
    parser.add_argument("--variants", nargs="+", default=["kd"], choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "outputs" / "bit_identical")
    args = parser.parse_args()
    out = args.out.resolve()
    task = out / "task"
    if not (task / "train.jsonl").exists():  # the demo's task files, as scripts/run_demo.sh writes them
        subprocess.run([sys.executable, "-m", "megatron_gkd.recipes.arithmetic", "--out", str(task)], cwd=ROOT,
                       check=True)
    sides = {"base": checkout(args.base, out), "head": checkout(args.head, out) if args.head else ROOT}
    same = True
    for variant in args.variants:
        runs = {side: run(tree, variant, args.steps, out / variant / side, task) for side, tree in sides.items()}
        compared, differ = differences(runs["base"], runs["head"])
        same &= not differ
        found = "; ".join(f"{key} from step {steps[0]} ({len(steps)} steps)" for key, steps in differ.items())
        print(f"{variant}: {args.steps} steps, {compared} metrics: " + (f"differ: {found}" if differ else "identical"),
              flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
