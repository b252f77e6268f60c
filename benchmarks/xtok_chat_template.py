"""A teacher of another tokenizer on a chat template (issue #45 item 8): a teacher that is the same function of text as
the same-tokenizer teacher (its vocabulary permuted) must distil the same.

    python benchmarks/xtok_chat_template.py --out outputs/xtok_chat_template                # same, permuted; seeds 1 2 3
    python benchmarks/xtok_chat_template.py --out outputs/xtok_chat_before --code DIR \\
        --assets outputs/xtok_chat_template/assets                                        # the trainer of another commit

The tiny assets (:mod:`megatron_gkd.recipes.tiny`: a random 4x256 teacher, a 2x128 student, 512 words) with
:data:`~megatron_gkd.recipes.tiny.CHAT_TEMPLATE` on both tokenizers: every prompt goes through a template whose markup
is special tokens and ends in one (``<s> w1 w2 </s> <s>``, as real templates end in ``<|im_start|>assistant\\n``).

==============  ==========================================================================================
``same``        the tiny teacher (the student's tokenizer)
``permuted``    the same teacher behind a permuted vocabulary (``build_cross_teachers``: it keeps the template),
                through ``teacher.cross_tokenizer.method=projected`` (``W`` a permutation)
==============  ==========================================================================================

Each run: on-policy forward KL from the teacher's top-16, the student sampling with its own weights
(``rollout.engine=megatron``), TP=1, one process, ``sync``, ``--steps`` steps of 16 samples (4 prompts x 4), one run at
a time; ``--mode off_policy``: the records' reference responses instead (16 prompts a step, nothing sampled), where
the two teachers must give the same loss at every step (on-policy the random student also samples special tokens
inside its responses, which the request path handles differently from the same-tokenizer one).

Measured: the held-out KL(teacher || student) over the whole vocabulary, float64, teacher-forced on ``eval.jsonl``'s
references through the template (``distill_quality.HeldOutKL``), of the start and of the run's final HF export; the
cut is ``1 - end / start``. ``--code DIR`` runs the trainer of another checkout (its ``configs/`` and
package; ``megatron_gkd/models`` and ``megatron_gkd/parallel`` linked as the GPU machine's set-up does) on the same
assets, for the figure before a change. Output: ``results.json`` and a Markdown table of the range over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from distill_quality import HeldOutKL

from megatron_gkd.launcher.commands import TRAINER_CLI
from megatron_gkd.recipes.tiny import CHAT_TEMPLATE, build_assets, build_cross_teachers, build_tokenizer
from megatron_gkd.testing import runs as harness

METHODS = {"same": [], "permuted": ["teacher.cross_tokenizer.method=projected"]}


def build(root: pathlib.Path) -> pathlib.Path:
    """The tiny assets with the chat template on both tokenizers, and the permuted teacher (``root/cross``)."""
    assets = build_assets(root)
    for name in ("student", "teacher"):  # before the permuted teacher: it takes the student's template
        build_tokenizer(assets / name, 512, chat_template=CHAT_TEMPLATE)
    build_cross_teachers(assets, root / "cross")
    return assets


def overrides(assets: pathlib.Path, method: str, seed: int, steps: int, mode: str) -> list[str]:
    teacher = assets / "cross" / "permuted" if method == "permuted" else assets / "teacher"
    samples = ["trainer.mode=off_policy", "rollout.n=1"] if mode == "off_policy" else []
    return [*samples, *harness.asset_overrides(assets), f"teacher.serve.model={teacher}", *METHODS[method],
            "parallel.tensor_model_parallel_size=1", "rollout.engine=megatron", "rollout.tensor_parallel_size=1",
            "trainer.scheduler=sync", f"trainer.num_steps={steps}", "optim.lr_warmup_steps=2",
            "eval.at_start=false", "eval.at_end=false", "eval.kl=false", "checkpoint.save_interval=null",
            "checkpoint.save_at_end=false", "checkpoint.hf_at_end=true",
            f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}"]


def run(code: pathlib.Path, out: pathlib.Path, args: list[str]) -> float:
    """One training run of the trainer in ``code``; its wall time."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
               TRAINER_CLI, "--config", str(code / "configs" / "cpu_tiny.yaml"), f"trainer.output_dir={out}",
               "logging.progress_bar=false", *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)}
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        code_ = subprocess.run(command, cwd=code, stdout=log, stderr=subprocess.STDOUT, env=environment).returncode
    if code_ != 0:
        raise RuntimeError(f"run {out} failed ({code_}): see {out.parent / f'{out.name}.log'}")
    return time.perf_counter() - start


def link_packages(code: pathlib.Path) -> None:
    """Another checkout's ``models/`` and ``parallel/`` as ``megatron_gkd.models`` / ``.parallel`` (pip installs them
    so; on ``PYTHONPATH`` they must lie inside the package)."""
    for name in ("models", "parallel"):
        link = code / "megatron_gkd" / name
        if not link.exists():
            link.symlink_to(code / name, target_is_directory=True)


def report(results: list[dict], start_kl: float) -> str:
    lines = ["| teacher | seeds | held-out KL at the end (min-max) | cut from the start, mean (min-max) | wall s a run |",
             "|---|---|---|---|---|", f"| start | | {start_kl:.4f} | | |"]
    for method in METHODS:
        found = [r for r in results if r["method"] == method]
        if not found:
            continue
        kls, cuts = [r["heldout_kl"] for r in found], [1 - r["heldout_kl"] / start_kl for r in found]
        lines.append(f"| `{method}` | {len(found)} | {min(kls):.4f}-{max(kls):.4f} | {statistics.mean(cuts):.1%} "
                     f"({min(cuts):.1%}-{max(cuts):.1%}) | {statistics.mean(r['wall_s'] for r in found):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs/xtok_chat_template"))
    parser.add_argument("--assets", type=pathlib.Path, help="assets built by an earlier run (default OUT/assets)")
    parser.add_argument("--code", type=pathlib.Path, default=harness.REPO, help="the checkout whose trainer runs")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mode", choices=["on_policy", "off_policy"], default="on_policy")
    args = parser.parse_args()
    args.out = args.out.resolve()  # the runs' working directory is the checkout that runs
    assets = build((args.assets or args.out / "assets").resolve())
    code = args.code.resolve()
    if code != harness.REPO:
        link_packages(code)
    kl = HeldOutKL(assets / "teacher", assets / "eval.jsonl")
    start_kl = kl(assets / "student")
    results = []
    for method in args.methods:
        for seed in args.seeds:
            out = args.out / f"{method}-seed{seed}"
            wall_s = run(code, out, overrides(assets, method, seed, args.steps, args.mode))
            export = max((out / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
            results.append({"method": method, "seed": seed, "heldout_kl": kl(export), "wall_s": wall_s,
                            "final_loss": harness.steps(out)[-1]["train/loss"]})
            print(json.dumps(results[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps({"start_kl": start_kl, "runs": results}, indent=1))
    table = report(results, start_kl)
    (args.out / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
