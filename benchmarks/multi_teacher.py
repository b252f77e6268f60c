"""Does routing each task to its own teacher pay? The multi-teacher experiment on the CPU (issue #20).

    python benchmarks/multi_teacher.py              # 4 methods x seeds 1 2 3, two runs at a time: ~40 min quiet
    python benchmarks/multi_teacher.py --report     # aggregate what has finished

The budget, 560,000 teacher tokens a run (as ``benchmarks/distill_quality.py``, whose ``forward_kl_n1`` is
``add2_only`` on one task), is about 850-950 steps: about 5 minutes a run on one core of a quiet machine.

The committed demo student (``assets/demo/student``) is distilled on two arithmetic tasks
(:func:`megatron_gkd.recipes.arithmetic.build_multi_task`, 20,000 training problems each): ``add2``, the
demo's addition, whose teacher is the demo's (``assets/demo/teacher``), and ``add3``, sums of three
numbers, whose teacher is ``assets/multi_teacher/teacher`` (``python -m megatron_gkd.recipes.multi_teacher
teacher``); each teacher does poorly on the other's task. At an equal budget of teacher tokens:

==================  ==============================================================================
``routed``          both teachers, each record scored by the teacher its ``task`` names
                    (``configs/multi_teacher_cpu.yaml``: ``teacher_mix.mode=route``), prompts of both tasks
``add2_only``       the addition teacher alone, on ``add2``'s prompts only
``add3_only``       the three-number teacher alone, on ``add3``'s prompts only
``add2_on_both``    the addition teacher alone on the prompts of both tasks (no routing: one teacher for all)
==================  ==============================================================================

Every run is the real entry point with the demo's settings (``configs/demo_cpu.yaml``: on-policy forward KL,
one sample per prompt, 64 prompts a step, the same learning-rate schedule) on one process (TP=1), ``sync``
scheduler, the teachers' top-4 (as ``benchmarks/distill_quality.py``), up to 16 response tokens (``add3``'s
worked solution is up to 14 and the end), and the same budget of response tokens trained
(``trainer.token_budget``: each scored by a teacher once); seeds change the data order and the sampling. The eval is
the same for every method: greedy, on the 500 + 500 held-out problems of both
tasks, reported per task (``data.group_key=task``: ``eval/accuracy/add2``, ``eval/accuracy/add3``) and
overall. A finished run leaves ``result.json`` in its directory and is not run again; the table covers
every finished run under ``--out``. Output: ``results.json``, a Markdown table (stdout and
``results.md``) and ``results.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import time

from distill_quality import DEMO_CONFIG, TOP_K, add_sweep_arguments, common_overrides

from megatron_gkd.recipes import arithmetic, demo, multi_teacher
from megatron_gkd.testing import runs as harness

logger = logging.getLogger("multi_teacher")

ROUTED_CONFIG = harness.REPO / "configs" / "multi_teacher_cpu.yaml"
TASKS = list(arithmetic.TASKS)  # add2, add3
TEACHERS = {"add2": demo.ASSETS / "teacher", "add3": multi_teacher.ASSETS / "teacher"}
# The demo's method, said explicitly; room for add3's longer worked solution; eval per task; no HF export
# (nothing here reads it).
SHARED = ["trainer.mode=on_policy", "rollout.n=1", "loss.type=forward_kl", f"rollout.max_tokens={multi_teacher.MAX_TOKENS}",
          f"eval.max_tokens={multi_teacher.MAX_TOKENS}", "data.group_key=task", "checkpoint.hf_at_end=false"]


def _one_teacher(task: str) -> list[str]:
    return [f"teacher.serve.model={TEACHERS[task]}", f"teacher.top_k={TOP_K}"]


# method -> (config, training prompts under the task directory, overrides)
METHODS = {
    "routed": (ROUTED_CONFIG, "train.jsonl", [f"teachers.{task}.top_k={TOP_K}" for task in TASKS]),
    "add2_only": (DEMO_CONFIG, "add2/train.jsonl", _one_teacher("add2")),
    "add3_only": (DEMO_CONFIG, "add3/train.jsonl", _one_teacher("add3")),
    "add2_on_both": (DEMO_CONFIG, "train.jsonl", _one_teacher("add2")),
}
KEYS = [*(f"eval/accuracy/{task}" for task in TASKS), "eval/accuracy"]  # per task, then overall


def overrides(method: str, seed: int, task_dir: pathlib.Path, common: list[str]) -> tuple[pathlib.Path, list[str]]:
    """The config and overrides of one run (later overrides win: the method's data path over common's)."""
    config, train, extra = METHODS[method]
    seeds = [f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}"]
    # distill_quality's common overrides set the one-teacher section's top-k, which the routed config turns off.
    common = [o for o in common if not (config == ROUTED_CONFIG and o.startswith("teacher.top_k="))]
    return config, [*common, *SHARED, f"data.train_path={task_dir / train}", *extra, *seeds]


# ------------------------------------------------------------------------------------------- runs
def run_record(out: pathlib.Path, method: str, seed: int, wall_s: float) -> dict:
    records = harness.metrics(out)
    steps = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    missing = [key for key in KEYS if key not in evals[-1]]
    if missing:
        raise RuntimeError(f"{out}: the final eval has no {missing} (is data.group_key=task honoured?)")
    tokens_at = {r["step"]: r["train/tokens_total"] for r in steps}
    return {"method": method, "seed": seed, "steps": steps[-1]["step"], "tokens": steps[-1]["train/tokens_total"],
            "accuracy": {key: evals[-1][key] for key in KEYS}, "wall_s": wall_s,
            "curve": [[tokens_at.get(r["step"], 0.0), *(r[key] for key in KEYS)] for r in evals]}


def run_all(jobs: list[tuple[str, int]], root: pathlib.Path, task_dir: pathlib.Path, common: list[str],
            parallel: int) -> None:
    """Runs the ``(method, seed)`` jobs that have no ``result.json`` yet, ``parallel`` at a time; a failed
    run stops the sweep (and every run still going)."""
    pending = [(m, s) for m, s in jobs if not (root / f"{m}-seed{s}" / "result.json").exists()]
    running: dict[tuple[str, int], tuple] = {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                method, seed = pending.pop(0)
                config, run_overrides = overrides(method, seed, task_dir, common)
                out = root / f"{method}-seed{seed}"
                running[method, seed] = (out, harness.start(out, run_overrides, nproc=1, config=config),
                                         time.perf_counter())
                logger.info("started %s seed %d (%d waiting)", method, seed, len(pending))
            time.sleep(5)
            for (method, seed), (out, process, began) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[method, seed]
                if process.returncode != 0:
                    raise RuntimeError(f"{method} seed {seed} failed ({process.returncode}): {harness.tail(process)}")
                record = run_record(out, method, seed, time.perf_counter() - began)
                (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")
                logger.info("%s seed %d: %s, %d steps, %d tokens, %.0f s", method, seed,
                            ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in record["accuracy"].items()),
                            record["steps"], record["tokens"], record["wall_s"])
    finally:
        for _, process, _ in running.values():  # a failed run or an interrupt: no run outlives the sweep
            harness.stop(process)


# --------------------------------------------------------------------------------------- reporting
def reference_accuracy(root: pathlib.Path, task_dir: pathlib.Path) -> dict[str, dict[str, float]]:
    """Held-out accuracy per task of the starting student and of each teacher (measured once, kept in
    ``references.json``: three vLLM start-ups)."""
    path = root / "references.json"
    if not path.exists():
        models = {"start": demo.ASSETS / "student", **{f"teacher {task}": TEACHERS[task] for task in TASKS}}
        path.write_text(json.dumps({name: multi_teacher.task_accuracy(model, task_dir) for name, model in models.items()},
                                   indent=1) + "\n")
    return json.loads(path.read_text())


def aggregate(results: list[dict]) -> dict:
    table = {}
    for method in METHODS:
        mine = [r for r in results if r["method"] == method]
        if not mine:
            continue
        row = {"seeds": sorted(r["seed"] for r in mine), "tokens": statistics.mean(r["tokens"] for r in mine),
               "steps": statistics.mean(r["steps"] for r in mine)}
        for key in KEYS:
            values = [r["accuracy"][key] for r in mine]
            row[key] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                        "min": min(values), "max": max(values), "values": values}
        table[method] = row
    return table


def markdown(table: dict, references: dict) -> str:
    headers = [f"`{task}` accuracy" for task in TASKS] + ["overall accuracy"]
    lines = [f"| method | seeds | {' | '.join(headers)} | teacher tokens | steps |",
             "|---|---|" + "---|" * len(KEYS) + "---|---|"]
    for name, accuracy in references.items():  # overall: both eval sets have 500 problems
        cells = [f"{accuracy[task]:.3f}" for task in TASKS] + [f"{statistics.mean(accuracy.values()):.3f}"]
        lines.append(f"| {name} | | {' | '.join(cells)} | | |")
    for method, row in table.items():
        cells = [f"{row[k]['mean']:.3f} ± {row[k]['std']:.3f} ({row[k]['min']:.3f}-{row[k]['max']:.3f})" for k in KEYS]
        lines.append(f"| `{method}` | {len(row['seeds'])} | {' | '.join(cells)} | {row['tokens']:,.0f} | {row['steps']:.0f} |")
    return "\n".join(lines)


def plot(table: dict, results: list[dict], references: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(table)
    figure, axes = plt.subplots(1, 1 + len(TASKS), figsize=(6 + 5 * len(TASKS), 4.8))
    width = 0.8 / len(KEYS)
    for offset, (key, color) in enumerate(zip(KEYS, ("tab:blue", "tab:orange", "lightgray"))):
        x = [i + (offset - (len(KEYS) - 1) / 2) * width for i in range(len(methods))]
        axes[0].bar(x, [table[m][key]["mean"] for m in methods], width, color=color, label=key.removeprefix("eval/"))
        for xi, method in zip(x, methods):
            axes[0].plot([xi] * len(table[method][key]["values"]), table[method][key]["values"], "k.", markersize=4)
    axes[0].set_xticks(range(len(methods)), methods, rotation=20, ha="right")
    axes[0].set(ylabel="final held-out accuracy", title="per task, mean of seeds (dots: seeds)", ylim=(0, 1))
    axes[0].legend(fontsize=8)
    for column, (axis, task) in enumerate(zip(axes[1:], TASKS), start=1):  # curve columns: tokens, then KEYS
        for method in methods:
            curves = [r["curve"] for r in results if r["method"] == method]
            length = min(len(c) for c in curves)
            axis.plot([statistics.mean(c[i][0] for c in curves) for i in range(length)],
                      [statistics.mean(c[i][column] for c in curves) for i in range(length)], marker="o", markersize=3,
                      label=method)
        axis.axhline(references[f"teacher {task}"][task], color="gray", linestyle="--", label=f"teacher {task}")
        axis.set(xlabel="teacher tokens", ylabel=f"held-out accuracy on {task} (mean of seeds)",
                 title=f"{task} against the budget", ylim=(0, 1))
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/multi_teacher_experiment")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    add_sweep_arguments(parser)
    args = parser.parse_args()
    from megatron_gkd.log_setup import setup_logging

    setup_logging("INFO")
    root = pathlib.Path(args.out).resolve()
    task_dir = arithmetic.build_multi_task(root / "task")
    jobs = [(method, seed) for seed in args.seeds for method in args.methods]  # every method's first seed first
    if not args.report:
        run_all(jobs, root, task_dir, common_overrides(task_dir, args.token_budget, args.num_steps, args.decay_steps),
                args.parallel)
    references = reference_accuracy(root, task_dir)
    results = [json.loads(path.read_text()) for path in sorted(root.glob("*-seed*/result.json"))]
    results = [r for r in results if r["method"] in METHODS]
    table = aggregate(results)
    text = markdown(table, references)
    (root / "results.json").write_text(json.dumps({"references": references, "top_k": TOP_K,
                                                   "token_budget": args.token_budget, "methods": table,
                                                   "runs": results}, indent=1) + "\n")
    (root / "results.md").write_text(text + "\n")
    if table:
        plot(table, results, references, root / "results.png")
    logger.info("\n%s\nwritten to %s", text, root)


if __name__ == "__main__":
    main()
