"""Do rewards pay on the demo's task? (issue #46 item 4): the teacher's signal and a verifiable reward, form by form.

    python benchmarks/rewards_pay.py                                  # every form, 3 seeds, two runs at a time
    python benchmarks/rewards_pay.py --forms kd_anneal --seeds 1      # some of it
    python benchmarks/rewards_pay.py --report                         # the table and plots of what has finished

Every run is the README's command (`scripts/run_demo.sh`: the demo's start at 0.050, its teacher at 0.904, its
1000 steps of 64 samples, its learning rate, `one_step_off`, colocated vLLM, TP=2) with one form's overrides and
a seed, so every form spends the same budget: 64,000 sampled responses scored by the teacher. The reward is the
eval's own scorer (`reward.kind=final_answer`: 1 for the exact answer). The forms with a reward sample 4
responses a prompt (16 prompts a step) for GRPO's groups; the demo samples one response for each of 64 prompts.
The report gives each run's held-out accuracy at every eval and the figures that say why a form did or did not
learn: how often a group's rewards differ (the only groups GRPO learns from), the mean reward, the sampled-token
KL to the teacher, the response length.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics

# `python benchmarks/rewards_pay.py` puts benchmarks/ on the path: the demo's runner and its curve reader.
from demo_spread import ROOT, SEED, curve, run_command

from megatron_gkd.recipes.report import read_metrics

REWARD = ["reward.kind=final_answer", "rollout.n=4", "rl.advantage=grpo", "rl.aggregation=token_mean"]
FORMS: dict[str, tuple[str, list[str]]] = {
    "forward_kl": ("the demo: forward KL over the teacher's 16 ids, no reward", []),
    "reward_only": ("GRPO on the reward alone (`rl.combine=loss`, `rl.kd_coef=0`)",
                    [*REWARD, "rl.combine=loss", "rl.kd_coef=0"]),
    "kd_plus_reward": ("GRPO + forward KL (`rl.combine=loss`, `rl.kd_coef=1`)", [*REWARD, "rl.combine=loss"]),
    "kd_anneal": ("forward KL annealed into GRPO (KDRL: `rl.kd_coef` 1 -> 0 over 600 steps)",
                  [*REWARD, "rl.combine=loss", "rl.kd_coef_end=0", "rl.kd_coef_steps=600"]),
    "advantage_k1": ("reward advantage - k1 of the teacher, less its group baseline (`rl.combine=advantage`)",
                     [*REWARD, "rl.combine=advantage", "rl.teacher_baseline=true"]),
    "teacher_k1": ("-k1 of the teacher less its group baseline as the advantage, no reward (`rl.combine=teacher`)",
                   [*REWARD, "rl.combine=teacher", "rl.teacher_baseline=true"]),
}
WHY = {"rl/informative_fraction": "groups whose rewards differ", "reward/mean": "mean reward",
       "pg/teacher_kl": "sampled-token KL to the teacher", "rollout/response_length_mean": "response length"}


def member(form: str, seed: int) -> str:
    return f"{form}_s{seed}"


def run(form: str, seed: int, out: pathlib.Path, extra: list[str]) -> dict:
    overrides = [*FORMS[form][1], *[s.format(n=seed) for s in SEED], *extra]
    return run_command(member(form, seed), out, overrides)


def informative_fraction(record: dict) -> float | None:
    """The fraction of a step's prompt groups whose rewards differ: under GRPO the others' advantages are all 0.
    From the step's reward range when the run did not log it (a step whose rewards are all equal has none)."""
    if "rl/informative_fraction" in record:
        return record["rl/informative_fraction"]
    if "reward/min" in record:
        return float(record["reward/max"] > record["reward/min"])
    return None


def summarise(directory: pathlib.Path) -> dict:
    steps, _ = read_metrics(directory)
    last = steps[-200:]
    figures = {}
    for key in WHY:
        values = [informative_fraction(r) if key == "rl/informative_fraction" else r.get(key) for r in last]
        values = [v for v in values if v is not None]
        figures[key] = statistics.fmean(values) if values else None
    return figures


def report(out: pathlib.Path, forms: list[str], seeds: list[int]) -> None:
    rows = [(form, seed, curve(out / member(form, seed))) for form in forms for seed in seeds]
    rows = [row for row in rows if row[2]]
    if not rows:
        print(f"nothing finished in {out}")
        return
    steps = sorted({step for *_, points in rows for step in points})
    print("| run | " + " | ".join(str(s) for s in steps) + " | " + " | ".join(WHY.values()) + " (last 200 steps) |")
    print("|---" * (len(steps) + len(WHY) + 1) + "|")
    for form, seed, points in rows:
        why = summarise(out / member(form, seed))
        cells = " | ".join(f"{points[s]:.3f}" if s in points else "" for s in steps)
        print(f"| {member(form, seed)} | {cells} | "
              + " | ".join("" if why[k] is None else f"{why[k]:.3f}" for k in WHY) + " |")
    print("\n| form | what trains the student | seeds | final accuracy, mean (min-max) |\n|---|---|---|---|")
    for form in forms:
        finals = [points[max(points)] for f, _, points in rows if f == form and max(points) == max(steps)]
        if finals:
            print(f"| `{form}` | {FORMS[form][0]} | {len(finals)} | {statistics.fmean(finals):.3f} "
                  f"({min(finals):.3f}-{max(finals):.3f}) |")
    plot(rows, out / "rewards_pay.png")


def plot(rows: list, path: pathlib.Path) -> None:
    """Held-out accuracy against steps, one colour a form, the teacher's 0.904 and the goal's 0.93 as lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    colours = dict(zip(FORMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    figure, axis = plt.subplots(figsize=(8, 4.5))
    labelled = set()
    for form, _, points in rows:
        steps = sorted(points)
        axis.plot(steps, [points[s] for s in steps], marker=".", color=colours[form],
                  label=None if form in labelled else form)
        labelled.add(form)
    axis.axhline(0.904, color="grey", linestyle="--", linewidth=1, label="teacher (0.904)")
    axis.axhline(0.93, color="black", linestyle=":", linewidth=1, label="goal (0.93)")
    axis.set(xlabel="step (64 samples each)", ylabel="held-out accuracy", ylim=(0, 1),
             title="the demo's task: the teacher's signal and a verifiable reward")
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default="outputs/rewards_pay")
    parser.add_argument("--report", action="store_true", help="only the table of what has finished")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, after the form's")
    args = parser.parse_args()
    out = ROOT / args.out
    if not args.report:
        out.mkdir(parents=True, exist_ok=True)
        jobs = [(form, seed) for seed in args.seeds for form in args.forms]  # a seed of every form first
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            for summary in pool.map(lambda job: run(*job, out, args.overrides), jobs):
                print(f"{summary['member']}: exit {summary['code']}, {summary['wall_s'] / 60:.1f} min", flush=True)
    report(out, args.forms, args.seeds)


if __name__ == "__main__":
    main()
