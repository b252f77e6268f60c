"""Do rewards pay on the demo's task? (issue #46 item 4): the teacher's signal and a verifiable reward, form by form.

    python benchmarks/rewards_pay.py                                  # every form, 3 seeds, two runs at a time
    python benchmarks/rewards_pay.py --forms kd_anneal --seeds 1      # some of it
    python benchmarks/rewards_pay.py --report                         # the table and plots of what has finished
    python benchmarks/rewards_pay.py --from-start --forms kd_plus_reward --seeds 1  # a form from the demo's start
    python benchmarks/rewards_pay.py --errors                         # where the students' errors are, pass@8 on them

Every form starts where the demo starts (0.050; its teacher is at 0.904) and spends the same budget of samples.
Phase 1 is the README's command itself (`scripts/run_demo.sh`: forward KL over the teacher's 16 ids, 1000 steps of
64 prompts with one sample each, its learning rate, `one_step_off`, colocated vLLM, TP=2), once per seed
(`distilled_s<n>`). Phase 2 starts from phase 1's exported student and trains 400 more steps of 64 samples with
each form, at a tenth of the demo's peak learning rate (3e-4 decayed to 3e-5). The reward is the eval's own scorer
(`reward.kind=final_answer`: 1 for the exact answer); the forms with a reward sample 4 responses for each of 16
prompts a step (GRPO's groups), `forward_kl` goes on as the demo (one for each of 64). Why two phases:
`--from-start` trains a form from the demo's start for the demo's 1000 steps instead, where 4 samples of 16 prompts
teach far less than one of 64 (docs/results.md).

The `verified_*` forms first have the teacher write responses to the training prompts and keep those the reward
accepts (`write_verified`, once per seed), then train on them off-policy.

The report gives each run's held-out accuracy at every eval and the figures that say why a form did or did not
learn: the mean reward, the sampled-token KL to the teacher, the response length (means over the last 200 steps).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import subprocess
import sys
import threading

# `python benchmarks/rewards_pay.py` puts benchmarks/ on the path: the demo's runner and its curve reader.
from demo_spread import ROOT, SEED, curve, run_command

from megatron_gkd.recipes.report import read_metrics

REWARD = ["reward.kind=final_answer", "rollout.n=4", "rl.advantage=grpo", "rl.aggregation=token_mean"]
SFT = ["trainer.mode=sft", "teacher.client=none"]
VERIFIED = "data.train_path={out}/verified_s{n}.jsonl"  # the teacher's responses the reward accepts (write_verified)
LONG = "trainer.num_steps=1000"
FORMS: dict[str, tuple[str, list[str]]] = {
    "forward_kl": ("the demo: forward KL over the teacher's 16 ids, no reward", []),
    "reward_only": ("GRPO on the reward alone (`rl.combine=loss`, `rl.kd_coef=0`)",
                    [*REWARD, "rl.combine=loss", "rl.kd_coef=0"]),
    "kd_plus_reward": ("GRPO + forward KL (`rl.combine=loss`, `rl.kd_coef=1`)", [*REWARD, "rl.combine=loss"]),
    "kd_anneal": ("forward KL annealed into GRPO (KDRL: `rl.kd_coef` 1 -> 0 over 200 steps)",
                  [*REWARD, "rl.combine=loss", "rl.kd_coef_end=0", "rl.kd_coef_steps=200"]),
    "advantage_k1": ("reward advantage - k1 of the teacher, less its group baseline (`rl.combine=advantage`)",
                     [*REWARD, "rl.combine=advantage", "rl.teacher_baseline=true"]),
    "teacher_k1": ("-k1 of the teacher less its group baseline as the advantage, no reward (`rl.combine=teacher`)",
                   [*REWARD, "rl.combine=teacher", "rl.teacher_baseline=true"]),
    "reward_dynamic": ("GRPO on the reward alone with DAPO's dynamic sampling (`rl.dynamic_sampling=true`: only groups "
                       "whose rewards differ; more samples drawn)",
                       [*REWARD, "rl.combine=loss", "rl.kd_coef=0", "rl.dynamic_sampling=true"]),
    # The next step after the first table (issue #46 item 4, second round): 8 samples of 8 prompts (more groups with a
    # right sample among them), two updates per batch (the PPO clip acts on the second).
    "kd_plus_reward_n8_ppo2": ("GRPO + forward KL, 8 samples x 8 prompts, 2 updates per batch (`rl.ppo_epochs=2`)",
                               [*REWARD, "rollout.n=8", "rl.combine=loss", "rl.ppo_epochs=2"]),
    "reward_n8_ppo2": ("GRPO on the reward alone, 8 samples x 8 prompts, 2 updates per batch",
                       [*REWARD, "rollout.n=8", "rl.combine=loss", "rl.kd_coef=0", "rl.ppo_epochs=2"]),
    # The third round: the same budget a step, a longer phase 2 (1000 steps) at a third of phase 2's learning rate, so
    # the new rate does not first undo what distillation taught (the dip at step 100 of both rounds above).
    "kd_plus_reward_long": ("GRPO + forward KL, 8 samples x 8 prompts, 1000 steps at 1e-4 decayed to 1e-5",
                            [*REWARD, "rollout.n=8", "rl.combine=loss", LONG, "optim.lr=1e-4", "optim.min_lr=1e-5"]),
    # The fourth round, from the errors' figures (--errors): the teacher writes, the verifier keeps the right answers,
    # and the student distils the teacher on those (rejection-sampled sequence-level KD; off-policy, both signals).
    "verified_kd": ("forward KL on the teacher's own responses that the reward accepts (`trainer.mode=off_policy` on "
                    "responses the teacher wrote: 4 samples at T=1 a training prompt, the first right one kept)",
                    ["trainer.mode=off_policy", VERIFIED]),
    # The same verified responses as targets rather than the teacher's distribution on them: rejection-sampling
    # fine-tuning on the teacher's samples (RFT). The teacher writes and the verifier chooses; no logits are distilled.
    "verified_sft": ("SFT on the teacher's own responses that the reward accepts (the same data as `verified_kd`)",
                     [*SFT, VERIFIED]),
    "verified_sft_long": ("`verified_sft` for 1000 steps (3e-4 decayed to 3e-5 over them): configs/demo_verified_sft.yaml",
                          [*SFT, VERIFIED, LONG]),
    # The fifth round: more of the teacher's right answers (8 samples a prompt, every right one kept): more prompts
    # covered and several right solutions of each.
    "verified_all_sft_long": ("`verified_sft_long` on every right response of 8 teacher samples a prompt",
                              [*SFT, "data.train_path={out}/verified_all_s{n}.jsonl", LONG]),
    # Not a form: what the records' own worked solutions (always right) teach this student with the same budget.
    "sft_ceiling": ("SFT on the records' worked solutions (the ground truth; no teacher, no reward)",
                    SFT),
    "sft_ceiling_long": ("`sft_ceiling` for 1000 steps (beside `verified_sft_long`)",
                         [*SFT, LONG]),
}
WHY = {"reward/mean": "mean reward", "pg/teacher_kl": "sampled-token KL to the teacher",
       "rollout/response_length_mean": "response length"}
DISTILL_STEPS = 1000  # the demo's
EVAL_TOKENS = 12  # the demo's eval.max_tokens
PHASE_2 = ["trainer.num_steps=400", "optim.lr=3e-4", "optim.min_lr=3e-5"]


def member(form: str, seed: int) -> str:
    return f"{form}_s{seed}"


def run(form: str, seed: int, out: pathlib.Path, extra: list[str], from_start: bool = False) -> dict:
    """Phase 2 of ``form`` from seed ``seed``'s distilled student, or (``from_start``) the form alone from the demo's
    start; ``form=None``: phase 1."""
    seeds = [s.format(n=seed) for s in SEED]
    if form is None:
        return run_command(member("distilled", seed), out, [*seeds, *extra])
    start = [] if from_start else [f"student.checkpoint={out / member('distilled', seed)}/hf/step_{DISTILL_STEPS}",
                                   *PHASE_2]
    if form in PREPARE:
        with PREPARING:  # one teacher engine at a time (two at once in two threads of one process hung)
            PREPARE[form](out, seed)
    overrides = [override.format(out=out, n=seed) for override in FORMS[form][1]]
    return run_command(member(form, seed), out, [*start, *overrides, *seeds, *extra])


def write_verified(out: pathlib.Path, seed: int, samples: int = 4, keep: int | None = 1,
                   name: str = "verified") -> pathlib.Path:
    """``<out>/<name>_s<seed>.jsonl``: for each training prompt of seed ``seed``'s task, the first ``keep`` of
    ``samples`` responses of the teacher (T=1) that the reward accepts, by the recipe's own command
    (``python -m megatron_gkd.recipes.teacher_samples --verify final_answer``, as configs/demo_verified_sft.yaml says;
    ``keep`` None: every right one); prompts with none are left out. A process of its own each time: the engines
    built one after another in this process kept their memory until vLLM refused the next KV cache."""
    from megatron_gkd.recipes import demo

    path = out / f"{name}_s{seed}.jsonl"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "megatron_gkd.recipes.teacher_samples", "--teacher",
                        str(demo.ASSETS / "teacher"), "--prompts", str(out / f"{member('distilled', seed)}_task" / "train.jsonl"),
                        "--out", str(path.with_suffix(".tmp")), "--n", str(samples), "--max-tokens", str(EVAL_TOKENS),
                        "--seed", str(seed), "--verify", "final_answer", *(["--keep", str(keep)] if keep else [])],
                       check=True, cwd=ROOT)
        path.with_suffix(".tmp").rename(path)
    return path


PREPARING = threading.Lock()
# Forms whose data is made first, once per seed.
PREPARE = {**dict.fromkeys(("verified_kd", "verified_sft", "verified_sft_long"), write_verified),
           "verified_all_sft_long": lambda out, seed: write_verified(out, seed, samples=8, keep=None,
                                                                     name="verified_all")}


def summarise(directory: pathlib.Path) -> dict:
    steps, _ = read_metrics(directory)
    last = steps[-200:]
    figures = {}
    for key in WHY:
        values = [r[key] for r in last if key in r]
        figures[key] = statistics.fmean(values) if values else None
    return figures


def report(out: pathlib.Path, forms: list[str], seeds: list[int], from_start: bool = False) -> None:
    rows = [(form, seed, curve(out / member(form, seed))) for form in ["distilled", *forms] for seed in seeds]
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
    for form in ["distilled", *forms]:
        ends = [max(points) for f, _, points in rows if f == form]
        finals = [points[max(points)] for f, _, points in rows if f == form and max(points) == max(ends)]
        if finals:
            what = FORMS[form][0] if form in FORMS else "phase 1: the demo"
            print(f"| `{form}` | {what} | {len(finals)} | {statistics.fmean(finals):.3f} "
                  f"({min(finals):.3f}-{max(finals):.3f}) |")
    plot(rows, out / "rewards_pay.png", from_start)


def plot(rows: list, path: pathlib.Path, from_start: bool = False) -> None:
    """Held-out accuracy against steps, one colour a form (the mean over seeds, each seed faint): the whole run on the
    left, phase 2 close up on the right, the teacher's 0.904 and the goal's 0.93 as lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    forms = list(dict.fromkeys(form for form, _, _ in rows))
    palette = plt.get_cmap("tab20").colors
    colours = {form: palette[i % len(palette)] for i, form in enumerate(forms)}
    figure, axes = plt.subplots(1, 2, figsize=(13, 5), width_ratios=(1, 1.3))
    for form in forms:
        offset = 0 if form == "distilled" or from_start else DISTILL_STEPS  # phase 2 follows phase 1
        runs = [points for f, _, points in rows if f == form]
        steps = sorted(set.intersection(*(set(points) for points in runs)))
        mean = [statistics.fmean(points[s] for points in runs) for s in steps]
        for axis in axes:
            for points in runs:
                axis.plot([s + offset for s in sorted(points)], [points[s] for s in sorted(points)],
                          color=colours[form], alpha=0.25, linewidth=0.8)
            axis.plot([s + offset for s in steps], mean, marker=".", color=colours[form], label=form)
    for axis in axes:
        axis.axhline(0.904, color="grey", linestyle="--", linewidth=1, label="teacher (0.904)")
        axis.axhline(0.93, color="black", linestyle=":", linewidth=1, label="goal (0.93)")
        axis.set(xlabel="step (64 samples each)", ylabel="held-out accuracy")
    axes[0].set(ylim=(0, 1), title="the demo's task: the teacher's signal and a verifiable reward")
    if not from_start:
        axes[1].set(xlim=(DISTILL_STEPS - 20, None), ylim=(0.84, 0.96), title="phase 2 (mean of the seeds, each seed faint)")
    axes[1].legend(fontsize=7, loc="lower right", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


def errors(out: pathlib.Path, seeds: list[int], samples: int = 8) -> None:
    """Where the student's held-out errors are and whether a reward can reach them: per seed, the phase-1 student's
    greedy errors, the share the teacher also gets wrong greedily, and how many of them a group of ``samples``
    responses at T=1 (GRPO's group) answers at least once, the student's samples and the teacher's (pass@n)."""
    from megatron_gkd.recipes import demo, greedy
    from megatron_gkd.rewards.answers import final_answer

    print(f"| seed | student's greedy errors | teacher also wrong | student pass@{samples} on them | "
          f"teacher pass@{samples} on them | teacher's greedy errors |\n|---|---:|---:|---:|---:|---:|")
    for seed in seeds:
        cache = out / f"errors_s{seed}.json"
        if not cache.exists():
            student = out / member("distilled", seed) / "hf" / f"step_{DISTILL_STEPS}"
            task = out / f"{member('distilled', seed)}_task" / "eval.jsonl"
            figures = {}
            for name, model in (("student", student), ("teacher", demo.ASSETS / "teacher")):
                greedy_scores, _ = greedy.sampled_scores(model, task, final_answer, max_tokens=EVAL_TOKENS)
                sampled, _ = greedy.sampled_scores(model, task, final_answer, max_tokens=EVAL_TOKENS, temperature=1.0,
                                                   n=samples, seed=seed)
                figures[name] = {"greedy": [row[0] for row in greedy_scores], "sampled": sampled}
            cache.write_text(json.dumps(figures) + "\n")
        figures = json.loads(cache.read_text())
        wrong = [i for i, score in enumerate(figures["student"]["greedy"]) if score < 1]
        teacher_wrong = [i for i in wrong if figures["teacher"]["greedy"][i] < 1]

        reached = {name: sum(max(figures[name]["sampled"][i]) >= 1 for i in wrong) for name in ("student", "teacher")}
        share = len(wrong) or 1
        print(f"| {seed} | {len(wrong)} of {len(figures['student']['greedy'])} | {len(teacher_wrong)} "
              f"({len(teacher_wrong) / share:.2f}) | {reached['student']} ({reached['student'] / share:.2f}) | "
              f"{reached['teacher']} ({reached['teacher'] / share:.2f}) | "
              f"{sum(score < 1 for score in figures['teacher']['greedy'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default="outputs/rewards_pay")
    parser.add_argument("--report", action="store_true", help="only the table of what has finished")
    parser.add_argument("--from-start", action="store_true", help="each form from the demo's start, no phase 1")
    parser.add_argument("--errors", action="store_true",
                        help="only where the phase-1 students' held-out errors are and whether a group reaches them")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, after the form's")
    args = parser.parse_args()
    out = ROOT / args.out
    if args.errors:
        errors(out, args.seeds)
        return
    if not args.report:
        out.mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            def submit(form, seed):
                return pool.submit(run, form, seed, out, args.overrides, args.from_start)

            if args.from_start:
                pending = {submit(form, seed) for seed in args.seeds for form in args.forms}
            else:  # a seed's forms start once its phase 1 has finished (or was finished before)
                pending = {submit(None, seed) for seed in args.seeds
                           if not (out / member("distilled", seed) / "hf" / f"step_{DISTILL_STEPS}").exists()}
                pending |= {submit(form, seed) for seed in args.seeds for form in args.forms
                            if (out / member("distilled", seed) / "hf" / f"step_{DISTILL_STEPS}").exists()}
            while pending:
                done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    summary = future.result()
                    print(f"{summary['member']}: exit {summary['code']}, {summary['wall_s'] / 60:.1f} min", flush=True)
                    if summary["member"].startswith("distilled_") and summary["code"] == 0:
                        seed = int(summary["member"].rsplit("_s", 1)[1])
                        pending |= {submit(form, seed) for form in args.forms}
    report(out, args.forms, args.seeds, args.from_start)


if __name__ == "__main__":
    main()
