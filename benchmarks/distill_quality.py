"""Which distillation method teaches the demo's student most per teacher token: the demo's experiment.

    python benchmarks/distill_quality.py                            # 25 methods, seeds 1 2 3 (about 4 hours)
    python benchmarks/distill_quality.py --methods forward_kl_hidden reverse_kl_hidden jsd_hidden   # hidden signal
    python benchmarks/distill_quality.py --methods forward_kl_tail reverse_kl_tail jsd_tail   # top-4 with its tail
    python benchmarks/distill_quality.py --methods reverse_kl_full_vocab jsd_full_vocab --seeds 1   # diagnostics
    python benchmarks/distill_quality.py --report                   # aggregate what has finished
    python benchmarks/distill_quality.py --out outputs/rl_with_teacher --methods grpo forward_kl rl_loss rl_advantage rl_teacher
    python benchmarks/distill_quality.py --out outputs/xtok_experiment --methods xtok_projected xtok_hybrid \
        xtok_projected_heads_only sft_numeral_samples forward_kl    # a teacher of another tokenizer (issue #29)
    python benchmarks/distill_quality.py --out outputs/gkd_mixture --methods forward_kl_n1 gkd_dataset_l0.0 \
        gkd_dataset_l0.5 gkd_teacher_l0.0 gkd_teacher_l0.5            # GKD's mixture (issue #30)

At an equal budget of teacher tokens (``trainer.token_budget``: response tokens trained, each scored by
the teacher once, or in SFT written by it), from the committed demo student (``assets/demo``) and
teacher, on the arithmetic task, it compares:

==========================  ========================================================================
``sft_teacher_samples``     off-policy SFT (cross-entropy) on responses the teacher sampled (T=1)
``kd_teacher_samples``      off-policy KD: the same teacher samples, the teacher's top-k, forward KL
``forward_kl`` ...          on-policy (the student samples ``rollout.n`` = 4 per prompt), one divergence
``forward_kl_n1``           on-policy forward KL with one sample per prompt: as many prompts per step as
                            the off-policy runs (a control for prompt diversity)
``tcad``                    on-policy TCAD: support-symmetric top-k truncation, coverage term,
                            teacher-confidence weights of each prompt's rollouts
``tcad_no_confidence``      TCAD without the confidence weights (token mean)
``tcad_no_coverage``        TCAD without the coverage term
``tcad_union``              TCAD on the union of both top-k lists (up to 2k ids) instead of the
                            interleaved truncation to k (which keeps about k/2 of the teacher's ids)
``tcad_alpha_0.0`` ...      TCAD with ``confidence_alpha`` 0, 0.1, 0.3 (``tcad`` has 1): 0 weighs each
                            prompt's rollouts equally
``reverse_kl_full_vocab``   diagnostics: ``reverse_kl`` / ``jsd`` with the teacher's whole vocabulary
``jsd_full_vocab``          (k = 16): what the top-k truncation costs them
``grpo``                    reward only: the exact final answer, GRPO's advantages over each prompt's 4
                            samples (``rl.combine=loss`` with ``rl.kd_coef=0``: the teacher weighs nothing)
``rl_loss``                 the policy gradient on the reward plus forward KL to the teacher's top-k
``rl_advantage``            the reward's advantage minus ``k1 = log pi_s - log pi_t`` of each sampled token
``rl_teacher``              the teacher alone as a policy gradient: advantage ``-k1`` (verl's OPD default)
``gkd_dataset_l0.5`` ...    GKD's mixture (``sample_mix``), one sample per prompt: each prompt's response is
                            the student's with probability lambda (0 or 0.5), else the record's own
                            reference response (``dataset``) or one the teacher writes at T=1 (``teacher``);
                            lambda 1 is ``forward_kl_n1``. The teacher scores every response (forward KL)
``xtok_projected`` ...      a teacher of another tokenizer (``assets/xtok/numeral_teacher``: the answer one
                            token), on-policy forward KL through ``teacher.cross_tokenizer.method`` projected or
                            hybrid (the chain rule inside numbers), or projected at group heads only
                            (``inside_groups=skip``), or read at the text level (``xtok_text``: boundary=text);
                            ``sft_numeral_samples``: SFT on its samples as text
``forward_kl_tail`` ...     on-policy ``forward_kl``, ``reverse_kl``, ``jsd`` on the top-4 with the tail bucket
                            (``loss.tail_bucket``): a true divergence over the 4 ids plus the mass outside them
``forward_kl_hidden`` ...   on-policy ``forward_kl``, ``reverse_kl``, ``jsd`` from the teacher's hidden
                            states (``teacher.signal=hidden``, bf16 on the wire): exact over the whole
                            vocabulary, the student recomputing the teacher's logits with its head
==========================  ========================================================================

Every run is the real entry point (``configs/demo_cpu.yaml``) on one process (TP=1: on this model TP=2
only adds communication), ``sync`` scheduler (staleness 0: on-policy means on-policy), the teacher's
top-``k`` with ``k`` = 4 of the 16-token vocabulary (with the whole vocabulary TCAD's truncation and
coverage term would be inert), the same learning-rate schedule, seeds for init-free things (data order,
sampling) per seed. Two runs at a time share the two cores; each run is one process and one thread.

Measured per run: the final greedy accuracy on the 500 held-out problems (the trainer's eval, vLLM), and
the held-out KL(teacher || student) over the full vocabulary, teacher-forced on the reference solutions
(float64, transformers, computed here from the run's HF export: the same tokens for every method).
A finished run leaves ``result.json`` in its directory and is not run again; the table covers every
finished run under ``--out``; ``--report`` only aggregates. Output: ``results.json``, a Markdown table
(stdout and ``results.md``) and ``results.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import time

from megatron_gkd.recipes import arithmetic, demo, teacher_samples
from megatron_gkd.testing import runs as harness

logger = logging.getLogger("distill_quality")

DEMO_CONFIG = harness.REPO / "configs" / "demo_cpu.yaml"
NUMERAL_TEACHER = harness.REPO / "assets" / "xtok" / "numeral_teacher"
TOP_K = 4
ON_POLICY = ["trainer.mode=on_policy", "rollout.n=4"]  # GKD's usual groups (TCAD's weights need them)
OFF_POLICY = ["rollout.n=1", "data.train_path={samples}"]
TCAD = ["loss.type=tcad", "loss.options.divergence=forward_kl", "loss.options.coverage_coef=1.0",
        "loss.confidence_alpha=1.0", f"loss.support_k={TOP_K}", f"rollout.logprobs_k={TOP_K}"]
METHODS = {
    "sft_teacher_samples": ["trainer.mode=sft", "teacher.client=none", "teacher.serve.model=null", *OFF_POLICY],
    "kd_teacher_samples": ["trainer.mode=off_policy", "loss.type=forward_kl", *OFF_POLICY],
    "forward_kl": [*ON_POLICY, "loss.type=forward_kl"],
    "forward_kl_n1": [*ON_POLICY, "loss.type=forward_kl", "rollout.n=1"],
    "reverse_kl": [*ON_POLICY, "loss.type=reverse_kl"],
    "jsd": [*ON_POLICY, "loss.type=jsd"],
    "kl_rkl": [*ON_POLICY, "loss.type=kl_rkl"],
    "tcad": [*ON_POLICY, *TCAD],
    "tcad_no_confidence": [*ON_POLICY, *TCAD, "loss.confidence_alpha=null"],
    "tcad_no_coverage": [*ON_POLICY, *TCAD, "loss.options.coverage_coef=0.0"],
    "tcad_union": [*ON_POLICY, *TCAD, "loss.support_mode=union"],
    # The confidence weights' sharpness: 0 weighs each prompt's rollouts equally (a sequence mean per
    # prompt, unlike tcad_no_confidence's token mean), 1 was configs/tcad.yaml's until
    # this sweep (it ships 0.3 now: docs/results.md).
    **{f"tcad_alpha_{alpha}": [*ON_POLICY, *TCAD, f"loss.confidence_alpha={alpha}"] for alpha in ("0.0", "0.1", "0.3")},
    # Diagnostics: the same divergences on the whole 16-token vocabulary (nothing outside the support).
    "reverse_kl_full_vocab": [*ON_POLICY, "loss.type=reverse_kl", "teacher.top_k=16"],
    "jsd_full_vocab": [*ON_POLICY, "loss.type=jsd", "teacher.top_k=16"],
}
# Rewards with the teacher (issue #28): the exact final answer as the reward, GRPO's group advantages over the
# rollout.n = 4 samples of a prompt, token-mean aggregation; rl.kd_coef = 1 where the teacher takes part.
REWARD = ["reward.kind=final_answer", "rl.advantage=grpo", "rl.aggregation=token_mean"]
METHODS.update({
    "grpo": [*ON_POLICY, *REWARD, "rl.combine=loss", "rl.kd_coef=0.0"],  # reward only (the teacher weighs 0)
    "rl_loss": [*ON_POLICY, *REWARD, "rl.combine=loss", "rl.kd_coef=1.0", "loss.type=forward_kl"],
    "rl_advantage": [*ON_POLICY, *REWARD, "rl.combine=advantage", "rl.kd_coef=1.0"],
    "rl_teacher": [*ON_POLICY, "reward.kind=final_answer", "rl.combine=teacher", "rl.kd_coef=1.0"],  # reward logged
})
RL_METHODS = ("grpo", "forward_kl", "rl_loss", "rl_advantage", "rl_teacher")  # issue #28's comparison
# Diagnostics: the teacher-in-the-advantage forms at a tenth of the demo's learning rate.
SLOW_LR = ["optim.lr=3.0e-4", "optim.min_lr=3.0e-5"]
METHODS.update({f"{name}_lr3e-4": [*METHODS[name], *SLOW_LR] for name in ("rl_advantage", "rl_teacher")})
# The teacher's hidden states instead of its top-k (issue #19): the whole vocabulary at any vocabulary size.
HIDDEN = ["teacher.signal=hidden", "teacher.hidden_dtype=bfloat16"]
METHODS.update({f"{loss}_hidden": [*ON_POLICY, f"loss.type={loss}", *HIDDEN] for loss in ("forward_kl", "reverse_kl", "jsd")})
# The tail bucket (issue #50 item 2): the same top-4 divergences over k + 1 outcomes, the teacher's 4 ids and the mass
# outside them on each side, instead of truncated (forward KL) or renormalised on the 4 ids (reverse KL, JSD).
METHODS.update({f"{loss}_tail": [*ON_POLICY, f"loss.type={loss}", "loss.tail_bucket=true"]
                for loss in ("forward_kl", "reverse_kl", "jsd")})
# GKD's mixture (issue #30): lambda in {0, 0.5} x source in {dataset, teacher}, drawn per prompt, one sample per
# prompt as forward_kl_n1 (lambda 1). The budget counts scored response tokens whatever wrote them; the teacher's
# generation of its own responses is not counted (it is the same order of work as scoring them).
MIX = [*ON_POLICY, "loss.type=forward_kl", "rollout.n=1", "sample_mix.per=prompt"]
METHODS.update({f"gkd_{source}_l{lmbda}": [*MIX, f"sample_mix.source={source}", f"sample_mix.lmbda={lmbda}"]
                for source in ("dataset", "teacher") for lmbda in ("0.0", "0.5")})
# A teacher of another tokenizer (issue #29 point 5): the numeral teacher (megatron_gkd/recipes/numeral_teacher.py:
# the answer one token, the demo teacher's shape and recipe) distilled into the demo's one-digit student, on-policy
# forward KL as `forward_kl` (whose same-tokenizer teacher is the ceiling), through each cross-tokenizer method; and
# SFT on the numeral teacher's samples as text (decoded by its tokenizer, read by the student's).
NUMERAL = ["teacher.serve.model={numeral}"]
METHODS.update({
    "xtok_projected": [*ON_POLICY, "loss.type=forward_kl", *NUMERAL, "teacher.cross_tokenizer.method=projected"],
    "xtok_hybrid": [*ON_POLICY, "loss.type=forward_kl", *NUMERAL, "teacher.cross_tokenizer.method=hybrid"],
    # The teacher read at the text level (boundary=text: the chain rule at every position, corrected for its token
    # boundaries): the teacher's boundary after a short answer's "1" means "the number 1", not the student's "1...".
    "xtok_text": [*ON_POLICY, "loss.type=forward_kl", *NUMERAL, "teacher.cross_tokenizer.method=projected",
                  "teacher.cross_tokenizer.boundary=text"],
    # One sample per prompt, as forward_kl_n1 (64 prompts a step): what the demo's student learns most from.
    "xtok_text_n1": [*ON_POLICY, "loss.type=forward_kl", *NUMERAL, "teacher.cross_tokenizer.method=projected",
                     "teacher.cross_tokenizer.boundary=text", "rollout.n=1"],
    "xtok_projected_heads_only": [*ON_POLICY, "loss.type=forward_kl", *NUMERAL,
                                  "teacher.cross_tokenizer.method=projected", "teacher.cross_tokenizer.inside_groups=skip"],
    "sft_numeral_samples": ["trainer.mode=sft", "teacher.client=none", "teacher.serve.model=null", "rollout.n=1",
                            "data.train_path={numeral_samples}"],
})
DIAGNOSTICS = ("reverse_kl_full_vocab", "jsd_full_vocab", "rl_advantage_lr3e-4", "rl_teacher_lr3e-4")  # on request


def common_overrides(task: pathlib.Path, budget: int, num_steps: int, decay_steps: int) -> list[str]:
    return [f"data.train_path={task / 'train.jsonl'}", f"data.eval_path={task / 'eval.jsonl'}",
            "parallel.tensor_model_parallel_size=1", "rollout.tensor_parallel_size=1", "trainer.scheduler=sync",
            # The micro-batch these experiments were measured with (the demo's config now trains in one of 64).
            "trainer.micro_batch_size=32",
            # Their start: the student on the plateau before the carries (0.002); the demo's config now starts from
            # the same SFT run 50 steps further (assets/demo/student_warm), which would hide what a method does there.
            f"student.checkpoint={demo.ASSETS / 'student'}",
            f"trainer.token_budget={budget}", f"trainer.num_steps={num_steps}", f"optim.lr_decay_steps={decay_steps}",
            f"teacher.top_k={TOP_K}", "eval.at_start=false", "eval.interval=250", "eval.kl=false",
            "checkpoint.save_interval=null", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=true"]


# ------------------------------------------------------------------------------------ held-out KL
class HeldOutKL:
    """KL(teacher || student) per response token over the full vocabulary, teacher-forced on the eval
    set's reference responses (EOS included), in float64; the teacher's log-probs are computed once."""

    def __init__(self, teacher: pathlib.Path, eval_path: pathlib.Path):
        import torch

        from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer

        tokenizer = load_tokenizer(str(teacher))
        dataset = load_prompts(str(eval_path), DataConfig(eval_path=str(eval_path)), tokenizer, require_responses=True)
        sequences = [(list(r.prompt_ids), list(r.response_ids)) for r in (dataset[i] for i in range(len(dataset)))]
        width = max(len(p) + len(r) for p, r in sequences)
        self.ids = torch.zeros(len(sequences), width, dtype=torch.long)
        self.mask = torch.zeros(len(sequences), width, dtype=torch.bool)  # True where the logits predict a response token
        for row, (prompt, response) in enumerate(sequences):
            self.ids[row, :len(prompt) + len(response)] = torch.tensor(prompt + response)
            self.mask[row, len(prompt) - 1:len(prompt) + len(response) - 1] = True
        self.teacher = self._logprobs(teacher)

    def _logprobs(self, model_dir: pathlib.Path):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        with torch.no_grad():  # right padding: causal attention never lets a real token see it
            logits = model(input_ids=self.ids).logits
        return torch.log_softmax(logits.double(), dim=-1)[self.mask]

    def __call__(self, student: pathlib.Path) -> float:
        log_q = self._logprobs(student)
        return float((self.teacher.exp() * (self.teacher - log_q)).sum(-1).mean())


# ------------------------------------------------------------------------------------------- runs
def run_record(out: pathlib.Path, method: str, seed: int, wall_s: float, kl: HeldOutKL) -> dict:
    records = harness.metrics(out)
    steps = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    exports = sorted((out / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    tokens_at = {r["step"]: r["train/tokens_total"] for r in steps}
    return {"method": method, "seed": seed, "steps": steps[-1]["step"], "tokens": steps[-1]["train/tokens_total"],
            "accuracy": evals[-1]["eval/accuracy"], "heldout_kl": kl(exports[-1]), "wall_s": wall_s,
            "curve": [[tokens_at.get(r["step"], 0.0), r["eval/accuracy"]] for r in evals]}


def run_all(jobs: list[tuple[str, int]], root: pathlib.Path, common: list[str], samples: dict, kl: HeldOutKL,
            parallel: int) -> None:
    """Runs the ``(method, seed)`` jobs without a ``result.json``, ``parallel`` at a time."""
    pending = [(m, s) for m, s in jobs if not (root / f"{m}-seed{s}" / "result.json").exists()]
    running: list = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                method, seed = pending.pop(0)
                out = root / f"{method}-seed{seed}"
                overrides = [o.format(**samples) for o in METHODS[method]]
                seeds = [f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}"]
                process = harness.start(out, common + overrides + seeds, nproc=1, config=DEMO_CONFIG)
                running.append((method, seed, out, process, time.perf_counter()))
                logger.info("started %s seed %d (%d waiting)", method, seed, len(pending))
            time.sleep(5)
            for job in [j for j in running if j[3].poll() is not None]:
                running.remove(job)
                _finish(*job, kl)
    finally:
        for job in running:  # a failed job or an interrupt: no run outlives the sweep
            harness.stop(job[3])


def _finish(method: str, seed: int, out: pathlib.Path, process, began: float, kl: HeldOutKL) -> None:
    if process.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed ({process.returncode}): {harness.tail(process)}")
    record = run_record(out, method, seed, time.perf_counter() - began, kl)
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    logger.info("%s seed %d: accuracy %.3f, held-out KL %.4f, %d steps, %d tokens, %.0f s", method, seed,
                record["accuracy"], record["heldout_kl"], record["steps"], record["tokens"], record["wall_s"])


# --------------------------------------------------------------------------------------- reporting
def aggregate(results: list[dict]) -> dict:
    table = {}
    for method in METHODS:
        mine = [r for r in results if r["method"] == method]
        if not mine:
            continue
        row = {"seeds": sorted(r["seed"] for r in mine), "tokens": statistics.mean(r["tokens"] for r in mine),
               "steps": statistics.mean(r["steps"] for r in mine)}
        for key in ("accuracy", "heldout_kl"):
            values = [r[key] for r in mine]
            row[key] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                        "min": min(values), "max": max(values), "values": values}
        table[method] = row
    return table


def markdown(table: dict, start: dict) -> str:
    lines = ["| method | seeds | final accuracy, mean ± std (min-max) | held-out KL, mean ± std (min-max) | teacher tokens | steps |",
             "|---|---|---|---|---|---|",
             f"| start (the committed student) | | {start['accuracy']:.3f} | {start['heldout_kl']:.4f} | 0 | 0 |"]
    for method, row in table.items():
        acc, kl = row["accuracy"], row["heldout_kl"]
        lines.append(f"| `{method}` | {len(row['seeds'])} | {acc['mean']:.3f} ± {acc['std']:.3f} ({acc['min']:.3f}-{acc['max']:.3f}) | "
                     f"{kl['mean']:.4f} ± {kl['std']:.4f} ({kl['min']:.4f}-{kl['max']:.4f}) | {row['tokens']:,.0f} | "
                     f"{row['steps']:.0f} |")
    return "\n".join(lines)


def plot(table: dict, results: list[dict], start: dict, teacher_accuracy: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(table)
    figure, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for axis, key, label in ((axes[0], "accuracy", "final held-out accuracy"),
                             (axes[1], "heldout_kl", "held-out KL(teacher || student), nats/token")):
        means = [table[m][key]["mean"] for m in methods]
        axis.bar(range(len(methods)), means, color="lightsteelblue")
        for i, method in enumerate(methods):
            axis.plot([i] * len(table[method][key]["values"]), table[method][key]["values"], "k.", markersize=5)
        axis.axhline(start[key], color="gray", linestyle=":", label="start")
        axis.set_xticks(range(len(methods)), methods, rotation=40, ha="right", fontsize=8)
        axis.set_title(label)
    axes[1].set_yscale("log")  # a collapsed run sits nats above the rest
    axes[0].axhline(teacher_accuracy, color="gray", linestyle="--", label="teacher")
    axes[0].legend(fontsize=8)
    colors = plt.get_cmap("tab20").colors  # one colour a method (the default cycle repeats after ten)
    for index, method in enumerate(methods):
        curves = [r["curve"] for r in results if r["method"] == method]
        length = min(len(c) for c in curves)
        tokens = [statistics.mean(c[i][0] for c in curves) for i in range(length)]
        accuracy = [statistics.mean(c[i][1] for c in curves) for i in range(length)]
        style = ":" if "full_vocab" in method else "--" if "teacher_samples" in method else "-"
        axes[2].plot(tokens, accuracy, marker="o", linestyle=style, markersize=3, color=colors[index % len(colors)],
                     label=method)
    axes[2].set(xlabel="teacher tokens", ylabel="held-out accuracy (mean of seeds)", title="accuracy against budget")
    axes[2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every equal-budget sweep shares (this one and benchmarks/multi_teacher.py)."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--token-budget", type=int, default=560_000,
                        help="teacher tokens per run (about 920-970 steps of 64 samples of ~9-9.5 tokens)")
    parser.add_argument("--num-steps", type=int, default=1200, help="a cap on steps (the budget ends runs first)")
    parser.add_argument("--decay-steps", type=int, default=1000, help="the learning rate's cosine decay, in steps")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (one process and thread each)")
    parser.add_argument("--report", action="store_true", help="only aggregate the finished runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/distill_quality")
    parser.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in DIAGNOSTICS],
                        choices=list(METHODS))
    add_sweep_arguments(parser)
    args = parser.parse_args()
    from megatron_gkd.log_setup import setup_logging

    setup_logging("INFO")
    root = pathlib.Path(args.out).resolve()
    task = arithmetic.build_task(root / "task")
    teacher = demo.ASSETS / "teacher"
    samples = root / "teacher_samples.jsonl"
    paths = {"samples": samples, "numeral": NUMERAL_TEACHER, "numeral_samples": root / "numeral_samples.jsonl"}
    for key, source in (("samples", teacher), ("numeral_samples", NUMERAL_TEACHER)):
        needed = any("{" + key + "}" in override for method in args.methods for override in METHODS[method])
        if not args.report and needed and not paths[key].exists():  # 4 per prompt: enough that no run reuses one
            teacher_samples.sample_teacher(source, task / "train.jsonl", paths[key].with_suffix(".partial"), n=4)
            paths[key].with_suffix(".partial").rename(paths[key])
    kl = HeldOutKL(teacher, task / "eval.jsonl")
    start = {"accuracy": json.loads((demo.ASSETS / "student" / "accuracy.json").read_text())["eval/accuracy"],
             "heldout_kl": kl(demo.ASSETS / "student")}
    jobs = [(method, seed) for seed in args.seeds for method in args.methods]  # every method's first seed first
    if not args.report:
        run_all(jobs, root, common_overrides(task, args.token_budget, args.num_steps, args.decay_steps), paths, kl,
                args.parallel)
    # Every finished run under the output directory, whichever invocation ran it.
    results = [json.loads(path.read_text()) for path in sorted(root.glob("*-seed*/result.json"))]
    results = [r for r in results if r["method"] in METHODS]
    table = aggregate(results)
    teacher_accuracy = json.loads((teacher / "accuracy.json").read_text())["eval/accuracy"]
    text = markdown(table, start)
    (root / "results.json").write_text(json.dumps({"start": start, "teacher_accuracy": teacher_accuracy,
                                                   "top_k": TOP_K, "token_budget": args.token_budget,
                                                   "methods": table, "runs": results}, indent=1) + "\n")
    (root / "results.md").write_text(text + "\n")
    plot(table, results, start, teacher_accuracy, root / "results.png")
    logger.info("teacher accuracy %.3f; teacher-sample accuracy %s\n%s\nwritten to %s", teacher_accuracy,
                teacher_samples.answer_accuracy(samples) if samples.exists() else "n/a", text, root)


if __name__ == "__main__":
    main()
