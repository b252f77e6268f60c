"""The demo's perturbation set (issue #30): does `bash scripts/run_demo.sh` land on every run, not one draw?

    python benchmarks/demo_spread.py                         # the whole set, two runs at a time
    python benchmarks/demo_spread.py --members command seed3  # some of it
    python benchmarks/demo_spread.py --report                # the table of what has finished
    python benchmarks/demo_spread.py --members command --parallel 1  # the command alone, for its wall time

A seeded run repeats itself bit for bit on one machine, but another CPU changes the last bits of the updates,
and the demo's exit from its plateau depends on them (docs/results.md). So a recipe is judged on a set of
runs that change those bits on purpose: the command's own seed and four others, and the command's seed with
its arithmetic changed (two micro-batches instead of one, two torch threads a rank instead of one, one vLLM
engine at TP=2 instead of two TP=1 replicas). Each member is the README's command itself, with its
overrides, in ``outputs/demo_spread/<member>``; its log is ``<member>.log`` beside it. The report gives each
member's held-out accuracy at every eval, the final one, the command's wall time and the log's lines and
WARNING lines. Wall times of runs made two at a time are not the command's: time it alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import time

from megatron_gkd.recipes.report import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = ["trainer.seed={n}", "rollout.seed={n}", "data.seed={n}"]
MEMBERS: dict[str, tuple[dict, list[str]]] = {
    "command": ({}, []),
    **{f"seed{n}": ({}, [s.format(n=n) for s in SEED]) for n in (1, 2, 3, 4)},
    "two_micro_batches": ({}, ["trainer.micro_batch_size=32"]),  # the config trains in one of 64
    "threads_2": ({"OMP_NUM_THREADS": "2"}, []),
    "rollout_tp2": ({}, ["rollout.tensor_parallel_size=2"]),
}


def run_member(name: str, out: pathlib.Path, extra: list[str]) -> dict:
    env_changes, overrides = MEMBERS[name]
    return run_command(name, out, extra + overrides, env_changes)


def run_command(name: str, out: pathlib.Path, overrides: list[str], env_changes: dict | None = None) -> dict:
    """The README's command with ``overrides``, in ``out/name`` (its log ``out/name.log``, summary ``out/name.json``)."""
    env_changes = env_changes or {}
    directory = out / name
    env = {**os.environ, **env_changes, "MEGATRON_GKD_OUTPUT_DIR": str(directory),
           "MEGATRON_GKD_TASK_DIR": str(out / f"{name}_task")}
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(["bash", "scripts/run_demo.sh", *overrides], cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT).returncode
    summary = {"member": name, "code": code, "wall_s": time.perf_counter() - start, "overrides": overrides,
               "env": env_changes}
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
    return summary


def curve(directory: pathlib.Path) -> dict[int, float]:
    if not (directory / "metrics.jsonl").exists():
        return {}
    return {int(r["step"]): r["eval/accuracy"] for r in read_metrics(directory)[1]}


def report(out: pathlib.Path) -> None:
    rows = []
    for summary_path in sorted(out.glob("*.json")):
        summary = json.loads(summary_path.read_text())
        name = summary["member"]
        points = curve(out / name)
        log = (out / f"{name}.log").read_text(errors="replace").splitlines()
        rows.append((name, points, summary, len(log), sum("WARNING" in line for line in log)))
    if not rows:
        print(f"nothing finished in {out}")
        return
    steps = sorted({step for _, points, *_ in rows for step in points})
    print("| member | " + " | ".join(str(s) for s in steps) + " | final | wall | log lines | WARNING |")
    print("|---" * (len(steps) + 5) + "|")
    finals = []
    for name, points, summary, lines, warnings in rows:
        final = points[max(points)] if points else float("nan")
        finals.append(final)
        cells = " | ".join(f"{points[s]:.3f}" if s in points else "" for s in steps)
        status = "" if summary["code"] == 0 else f" (exit {summary['code']})"
        print(f"| {name}{status} | {cells} | **{final:.3f}** | {summary['wall_s'] / 60:.1f} min | {lines} | {warnings} |")
    landed = sum(final >= 0.8 for final in finals)
    print(f"\n{landed}/{len(finals)} at >= 0.8; finals {min(finals):.3f}-{max(finals):.3f}")
    plot(rows, out / "spread.png")


def plot(rows: list, path: pathlib.Path) -> None:
    """Every member's held-out accuracy against steps, on one axis (the spread at a glance)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, points, *_ in rows:
        steps = sorted(points)
        axis.plot(steps, [points[s] for s in steps], marker=".", label=name)
    axis.axhline(0.8, color="grey", linestyle="--", linewidth=1, label="the bar (0.8)")
    axis.set(xlabel="step", ylabel="held-out accuracy", ylim=(0, 1), title="the demo's perturbation set")
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", nargs="+", default=list(MEMBERS), choices=list(MEMBERS))
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default="outputs/demo_spread")
    parser.add_argument("--report", action="store_true", help="only the table of what has finished")
    parser.add_argument("overrides", nargs="*", help="config overrides for every member (a recipe to try); a "
                        "member's own change comes after them, so it still applies")
    args = parser.parse_args()
    out = ROOT / args.out
    if not args.report:
        out.mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            for summary in pool.map(lambda name: run_member(name, out, args.overrides), args.members):
                print(f"{summary['member']}: exit {summary['code']}, {summary['wall_s'] / 60:.1f} min", flush=True)
    report(out)


if __name__ == "__main__":
    main()
