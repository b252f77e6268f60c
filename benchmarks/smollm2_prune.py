"""Which way recovers a pruned SmolLM2-135M-Instruct best per teacher token: the pruning example's experiment.

    python benchmarks/smollm2_prune.py                             # depth: 4 methods; width: on-policy; seeds 1 2 3
    python benchmarks/smollm2_prune.py --variants width --methods on_policy kd_teacher_samples --seeds 1
    python benchmarks/smollm2_prune.py --report                    # aggregate what has finished

The teacher is the full model, the students are :mod:`megatron_gkd.recipes.smollm2_prune`'s (``depth``: 10 of 30
layers; ``width``: hidden 384, 6 heads, MLP 912; 63.7M parameters each), the prompts
:mod:`megatron_gkd.recipes.instructions`' (377 training, 127 held-out questions on facts no training prompt asks
about). At an equal budget of teacher tokens (``trainer.token_budget``: response tokens trained, each scored by the
teacher once, or in SFT written by it) it compares:

=======================  ===========================================================================================
``on_policy``            the example: the student samples one response a prompt, forward KL to the teacher's top-32
``gkd_mixture``          GKD's mixture: each prompt's response is the student's with probability 0.5, else one the
                         teacher sampled beforehand (``sample_mix.source=dataset`` over the teacher's samples)
``kd_teacher_samples``   off-policy KD: the teacher's samples, scored by the teacher (forward KL, top-32)
``sft_teacher_samples``  SFT: cross-entropy on the teacher's samples (no teacher at training time)
=======================  ===========================================================================================

The teacher's samples: 4 a training prompt at temperature 1, ``max_tokens`` 32, those that end (not cut) kept.

Measured per run (float64, transformers, from the run's HF export): the held-out KL(teacher || student) per token
over the whole vocabulary, teacher-forced on the teacher's own greedy answers to the held-out prompts (the same
tokens for every method, so no method is rewarded for the responses it chose to write), and the held-out accuracy
of the student's greedy answers (``contains``, the trainer's eval). Runs use the example's config
(``configs/smollm2_prune_cpu.yaml``: DP=2, colocated vLLM, ``one_step_off``); one at a time. A finished run leaves
``result.json`` and is not run again; the table covers every finished run under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import subprocess
import sys
import time

from megatron_gkd.recipes import smollm2_prune
from megatron_gkd.testing import runs as harness

logger = logging.getLogger("smollm2_prune")

CONFIG = harness.REPO / "configs" / "smollm2_prune_cpu.yaml"
ON_SAMPLES = ["data.train_path={samples}"]
METHODS = {
    "on_policy": [],
    "gkd_mixture": ["sample_mix.lmbda=0.5", "sample_mix.per=prompt", "sample_mix.source=dataset", *ON_SAMPLES],
    "kd_teacher_samples": ["trainer.mode=off_policy", *ON_SAMPLES],
    "sft_teacher_samples": ["trainer.mode=sft", "teacher.client=none", "teacher.serve.model=null", *ON_SAMPLES],
}
DEFAULT_JOBS = [("depth", method) for method in METHODS] + [("width", "on_policy")]


class HeldOutKL:
    """KL(teacher || student) per token of the teacher's greedy answers to the held-out prompts, over the whole
    vocabulary in float64, one sequence at a time (a batch of 49,152-wide float64 rows would not fit)."""

    def __init__(self, teacher: pathlib.Path, reference: pathlib.Path):
        from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer

        tokenizer = load_tokenizer(str(teacher))
        dataset = load_prompts(str(reference), DataConfig(eval_path=str(reference)), tokenizer, require_responses=True)
        self.sequences = [(list(r.prompt_ids), list(r.response_ids)) for r in (dataset[i] for i in range(len(dataset)))]
        self.teacher = self._model(teacher)

    @staticmethod
    def _model(path):
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def __call__(self, student: pathlib.Path) -> float:
        import torch

        model, total, count = self._model(student), 0.0, 0
        with torch.no_grad():
            for prompt, response in self.sequences:
                ids = torch.tensor([prompt + response])
                rows = slice(len(prompt) - 1, len(prompt) + len(response) - 1)  # the logits that predict the response
                log_p = torch.log_softmax(self.teacher(input_ids=ids).logits[0, rows].double(), dim=-1)
                log_q = torch.log_softmax(model(input_ids=ids).logits[0, rows].double(), dim=-1)
                total += float((log_p.exp() * (log_p - log_q)).sum())
                count += len(response)
        return total / count


def common_overrides(prepared: dict, variant: str, budget: int, num_steps: int) -> list[str]:
    task = pathlib.Path(prepared["task"])
    return [f"student.checkpoint={pathlib.Path(prepared['student']).parent / f'student_{variant}'}",
            f"teacher.serve.model={prepared['teacher']}", f"data.train_path={task / 'train.jsonl'}",
            f"data.eval_path={task / 'eval.jsonl'}", f"trainer.token_budget={budget}", f"trainer.num_steps={num_steps}",
            f"optim.lr_decay_steps={num_steps}", "eval.at_start=false", "eval.interval=null", "eval.kl=false",
            "checkpoint.save_interval=null", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=true"]


def run_one(root: pathlib.Path, variant: str, method: str, seed: int, common: list[str], samples: pathlib.Path,
            kl: HeldOutKL) -> dict:
    out = root / f"{variant}-{method}-seed{seed}"
    if (out / "result.json").exists():
        return json.loads((out / "result.json").read_text())
    overrides = [o.format(samples=samples) for o in METHODS[method]]
    seeds = [f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}"]
    began = time.perf_counter()
    code, log = harness.run(out, common + overrides + seeds, nproc=2, config=CONFIG, timeout_s=7200)
    if code != 0:
        raise RuntimeError(f"{variant} {method} seed {seed} failed ({code}): {log[-3000:]}")
    records = harness.metrics(out)
    steps = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    exports = sorted((out / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    record = {"variant": variant, "method": method, "seed": seed, "steps": steps[-1]["step"],
              "tokens": steps[-1]["train/tokens_total"], "accuracy": evals[-1]["eval/accuracy"],
              "heldout_kl": kl(exports[-1]), "wall_s": time.perf_counter() - began,
              "loss": [[r["train/tokens_total"], r["train/loss"]] for r in steps]}
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    logger.info("%s %s seed %d: accuracy %.3f, held-out KL %.4f, %d steps, %d tokens, %.0f s", variant, method, seed,
                record["accuracy"], record["heldout_kl"], record["steps"], record["tokens"], record["wall_s"])
    return record


def starts(root: pathlib.Path, prepared: dict, variants, kl: HeldOutKL) -> dict:
    """Each student's held-out KL and accuracy before any training (and the teacher's accuracy), measured once."""
    path = root / "starts.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    task = pathlib.Path(prepared["task"])
    for variant in variants:
        if variant not in found:
            student = pathlib.Path(prepared["student"]).parent / f"student_{variant}"
            found[variant] = {"heldout_kl": kl(student),
                              "accuracy": smollm2_prune.greedy_accuracy(student, task / "eval.jsonl")[0]}
    found["teacher"] = {"heldout_kl": 0.0, "accuracy": prepared["teacher_accuracy"]}
    path.write_text(json.dumps(found, indent=1) + "\n")
    return found


def table(results: list[dict], start: dict) -> str:
    lines = ["| student | method | seeds | held-out KL, mean (min-max) | accuracy, mean (min-max) | teacher tokens | steps |",
             "|---|---|---|---|---|---|---|",
             f"| teacher (134.5M) | | | 0 | {start['teacher']['accuracy']:.3f} | | |"]
    for variant in ("depth", "width"):
        if variant in start:
            lines.append(f"| {variant} (63.7M), pruned | | | {start[variant]['heldout_kl']:.3f} | "
                         f"{start[variant]['accuracy']:.3f} | 0 | 0 |")
        for method in METHODS:
            mine = [r for r in results if r["variant"] == variant and r["method"] == method]
            if not mine:
                continue
            kls, accs = [r["heldout_kl"] for r in mine], [r["accuracy"] for r in mine]
            lines.append(f"| {variant} | `{method}` | {len(mine)} | {statistics.mean(kls):.3f} ({min(kls):.3f}-"
                         f"{max(kls):.3f}) | {statistics.mean(accs):.3f} ({min(accs):.3f}-{max(accs):.3f}) | "
                         f"{statistics.mean(r['tokens'] for r in mine):,.0f} | {statistics.mean(r['steps'] for r in mine):.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], start: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (kl_axis, loss_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    jobs = sorted({(r["variant"], r["method"]) for r in results})
    for index, (variant, method) in enumerate(jobs):
        mine = [r for r in results if (r["variant"], r["method"]) == (variant, method)]
        kl_axis.plot([index] * len(mine), [r["heldout_kl"] for r in mine], "o", color=f"C{index}")
        for r in mine:
            loss_axis.plot([t for t, _ in r["loss"]], [v for _, v in r["loss"]], color=f"C{index}", alpha=0.6,
                           label=f"{variant} {method}" if r is mine[0] else None)
    kl_axis.set_xticks(range(len(jobs)), [f"{v}\n{m}" for v, m in jobs], fontsize=8)
    for variant, style in (("depth", ":"), ("width", "--")):
        if variant in start:
            kl_axis.axhline(start[variant]["heldout_kl"], color="gray", linestyle=style, label=f"{variant}, pruned")
    kl_axis.set(ylabel="held-out KL(teacher || student), nats/token", title="after training (each seed)")
    kl_axis.legend(fontsize=8)
    loss_axis.set(xlabel="teacher tokens", ylabel="training loss", title="training loss against budget", yscale="log")
    loss_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs/smollm2_prune_experiment"))
    parser.add_argument("--variants", nargs="+", choices=["depth", "width"])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--token-budget", type=int, default=24_000, help="teacher tokens per run")
    parser.add_argument("--num-steps", type=int, default=120, help="a cap on steps (the budget ends runs first)")
    parser.add_argument("--report", action="store_true", help="only aggregate the finished runs")
    args = parser.parse_args()
    from megatron_gkd.log_setup import setup_logging

    setup_logging("INFO")
    jobs = [(v, m) for v, m in DEFAULT_JOBS if (args.variants is None or v in args.variants)
            and (args.methods is None or m in args.methods)] if args.variants is None or args.methods is None else \
        [(v, m) for v in args.variants for m in args.methods]
    prepared = {variant: smollm2_prune.prepare(args.out, variant) for variant in sorted({v for v, _ in jobs})}
    first = next(iter(prepared.values()))
    samples = args.out / "teacher_samples.jsonl"
    if not samples.exists() and not args.report:  # in a process of its own: vLLM on CPU counts this one's memory
        subprocess.run([sys.executable, "-m", "megatron_gkd.recipes.teacher_samples", "--teacher", first["teacher"],
                        "--prompts", str(pathlib.Path(first["task"]) / "train.jsonl"), "--n", "4",
                        "--max-tokens", "32", "--max-model-len", "256", "--out", str(samples.with_suffix(".partial"))],
                       check=True)
        samples.with_suffix(".partial").rename(samples)
    kl = HeldOutKL(pathlib.Path(first["teacher"]), pathlib.Path(first["task"]) / "eval_teacher.jsonl")
    start = starts(args.out, first, sorted(prepared), kl)
    results = []
    for seed in args.seeds:  # every job's first seed first: a sweep cut short still compares them all
        for variant, method in jobs:
            done = args.out / f"{variant}-{method}-seed{seed}" / "result.json"
            if args.report:
                if done.exists():
                    results.append(json.loads(done.read_text()))
                continue
            common = common_overrides(prepared[variant], variant, args.token_budget, args.num_steps)
            results.append(run_one(args.out, variant, method, seed, common, samples, kl))
    text = table(results, start)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"start": start, "runs": results}, indent=1) + "\n")
    plot(results, start, args.out / "results.png")
    print(text)


if __name__ == "__main__":
    main()
