"""Self-distillation with privileged context against the demo's teacher (issue #50 item 3).

    python benchmarks/self_distill.py                 # 3 seeds of self-distillation, two runs at a time
    python benchmarks/self_distill.py --seeds 1       # some of it
    python benchmarks/self_distill.py --report        # the table of what has finished

Every run is the README's command (`scripts/run_demo.sh`: 1000 steps of 64 prompts, one sample each, TP=2,
colocated vLLM, the demo's learning rate) from the demo's start (0.050), so the budget of samples is the demo's.
`self_current` replaces the served 3-layer teacher (0.904) with the student itself (`teacher.client=self`, its
current weights without gradient) reading the record's worked solution before the question (TEMPLATE: the same
problem solved in the student's own format, then asked again). The baseline is the demo itself per seed: phase 1
of `benchmarks/rewards_pay.py` (`<baseline>/distilled_s<n>`, run here when missing).

Measured per run: the held-out greedy accuracy at every eval (the trainer's), and, from the start's and each run's
final HF export, the greedy accuracy of the same model reading the privileged prompt (the self teacher's own
accuracy: what the student is distilled towards), both through vLLM as the eval scores them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics

# `python benchmarks/self_distill.py` puts benchmarks/ on the path: the demo's runner and its curve reader.
from demo_spread import ROOT, SEED, curve, run_command
from rewards_pay import member
from rewards_pay import run as run_demo_seed

from megatron_gkd.recipes import demo, greedy
from megatron_gkd.rewards.answers import final_answer

TEMPLATE = "{prompt} {response} {prompt}"
FORMS = {"self_current": ["teacher.client=self", "teacher.serve.model=null", "teacher.self_weights=current",
                          f'teacher.privileged_template="{TEMPLATE}"']}
DEMO_STEPS = 1000
MAX_TOKENS = 12  # the demo's eval.max_tokens


def privileged_eval(task: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The held-out problems with TEMPLATE's prompt (the self teacher's), same answers."""
    rows = [json.loads(line) for line in (task / "eval.jsonl").read_text().splitlines()]
    out.write_text("".join(json.dumps({"prompt": TEMPLATE.format(**row), "answer": row["answer"]}) + "\n"
                           for row in rows))
    return out


def accuracies(model: pathlib.Path, task: pathlib.Path, privileged: pathlib.Path) -> dict:
    return {name: greedy.greedy_accuracy(model, path, final_answer, max_tokens=MAX_TOKENS)[0]
            for name, path in (("plain", task / "eval.jsonl"), ("privileged", privileged))}


def measure(directory: pathlib.Path, task: pathlib.Path, privileged: pathlib.Path) -> dict | None:
    """The final export's plain and privileged accuracy, cached in ``<run>/self_distill.json``."""
    cache = directory / "self_distill.json"
    if cache.exists():
        return json.loads(cache.read_text())
    export = directory / "hf" / f"step_{DEMO_STEPS}"
    if not export.exists():
        return None
    figures = accuracies(export, task, privileged)
    cache.write_text(json.dumps(figures, indent=1))
    return figures


def report(out: pathlib.Path, baseline: pathlib.Path, seeds: list[int]) -> None:
    task = out / "task"
    privileged = privileged_eval(task, out / "privileged_eval.jsonl")
    start = out / "start.json"
    if not start.exists():
        start.write_text(json.dumps(accuracies(demo.ASSETS / "student_warm", task, privileged), indent=1))
    start_figures = json.loads(start.read_text())
    print(f"start (assets/demo/student_warm): held-out {start_figures['plain']:.3f}, "
          f"reading the privileged prompt {start_figures['privileged']:.3f}")
    print("\n| run | final held-out accuracy | the same model reading the privileged prompt | evals |\n|---|---|---|---|")
    finals: dict[str, list[float]] = {}
    curves: list[tuple[str, dict[int, float]]] = []
    for form, directory in [("demo", baseline / member("distilled", s)) for s in seeds] + \
                           [(form, out / member(form, s)) for form in FORMS for s in seeds]:
        points = curve(directory)
        if not points:
            continue
        figures = measure(directory, task, privileged)  # None for a run stopped before its end (no export)
        finals.setdefault(form, []).append(points[max(points)])
        curves.append((form, points))
        evals = ", ".join(f"{step}: {points[step]:.3f}" for step in sorted(points))
        reading = "n/a (stopped before its export)" if figures is None else f"{figures['privileged']:.3f}"
        print(f"| {form} ({directory.name}) | {points[max(points)]:.3f} (step {max(points)}) | {reading} | {evals} |")
    print("\n| form | seeds | final accuracy, mean (min-max) |\n|---|---|---|")
    for form, values in finals.items():
        print(f"| `{form}` | {len(values)} | {statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f}) |")
    plot(curves, start_figures, out / "self_distill.png")


def plot(curves: list[tuple[str, dict[int, float]]], start: dict, path: pathlib.Path) -> None:
    """Held-out accuracy against steps, one colour a form, with the teacher's 0.904 and the start's privileged
    reading."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    labelled = set()
    for form, points in curves:
        steps = sorted(points)
        colour = "tab:blue" if form == "demo" else "tab:red"
        axis.plot(steps, [points[s] for s in steps], marker=".", color=colour,
                  label=None if form in labelled else {"demo": "the demo (forward KL from the teacher)"}.get(form, form))
        labelled.add(form)
    axis.axhline(0.904, color="grey", linestyle="--", linewidth=1, label="teacher (0.904)")
    axis.axhline(start["privileged"], color="tab:red", linestyle=":", linewidth=1,
                 label=f"the start reading the privileged prompt ({start['privileged']:.3f})")
    axis.set(xlabel="step (64 samples each)", ylabel="held-out accuracy", ylim=(-0.02, 1),
             title="self-distillation with privileged context against the demo")
    axis.legend(fontsize=7, loc="center right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default="outputs/self_distill")
    parser.add_argument("--baseline", default="outputs/rewards_pay", help="where the demo's runs per seed are")
    parser.add_argument("--report", action="store_true", help="only the table of what has finished")
    args = parser.parse_args()
    out, baseline = ROOT / args.out, ROOT / args.baseline
    out.mkdir(parents=True, exist_ok=True)
    from megatron_gkd.recipes import arithmetic

    arithmetic.build_task(out / "task")  # the demo's task (deterministic): for the privileged accuracy
    if not args.report:
        baseline.mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            jobs = [pool.submit(run_command, member(form, seed), out, [*FORMS[form], *(s.format(n=seed) for s in SEED)])
                    for seed in args.seeds for form in FORMS]
            jobs += [pool.submit(run_demo_seed, None, seed, baseline, []) for seed in args.seeds
                     if not (baseline / member("distilled", seed) / "hf" / f"step_{DEMO_STEPS}").exists()]
            for job in concurrent.futures.as_completed(jobs):
                summary = job.result()
                print(f"{summary['member']}: exit {summary['code']}, {summary['wall_s'] / 60:.1f} min", flush=True)
    report(out, baseline, args.seeds)


if __name__ == "__main__":
    main()
