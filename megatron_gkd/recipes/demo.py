"""Reproduces the distillation demo's committed models (``assets/demo``) with the trainer's SFT mode.

``teacher``: the arithmetic task (:mod:`.arithmetic`), its trained tokenizer, a random Qwen3 teacher
(3 layers, 192 wide) trained from scratch by ``torchrun launch/pretrain_gkd.py`` in ``trainer.mode=sft``
(``configs/demo_teacher_sft.yaml``, 4000 steps: 0.904 on the held-out set), its HF export copied to ``assets/demo/teacher``.
``student``: a smaller random Qwen3 (2 layers, 128 wide) given an SFT warm start with the same config
(750 steps at a constant learning rate: it writes the format but sits on the plateau that precedes
learning the carries, 0.002 on the held-out set, far below the teacher); copied to
``assets/demo/student``; the method comparisons of docs/results.md start from it.
``student_warm``: the same SFT run stopped at step 800, where the carries have begun (the worked part right
on 0.082 of the held-out problems, the answer on 0.050); the demo (``configs/demo_cpu.yaml``) distils it.
The task files themselves are not committed: they are rebuilt from the seed.

    python -m megatron_gkd.recipes.demo teacher         # about 8 minutes on 2 CPU cores
    python -m megatron_gkd.recipes.demo student         # about 1 minute
    python -m megatron_gkd.recipes.demo student_warm    # about 1 minute

Each script reproduces its model bit for bit on the machine that made it, not on another CPU: 750 steps
amplify the last bits that another machine's kernels change (``student``, made on another machine, differs
here by up to 0.6 in a weight and scores 0.026 instead of 0.002).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

from megatron_gkd.launcher.commands import TRAINER_CLI
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.recipes import arithmetic, tiny

logger = logging.getLogger(__name__)

REPO = pathlib.Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "demo"
SFT_CONFIG = REPO / "configs" / "demo_teacher_sft.yaml"

MODELS = {
    "teacher": dict(hidden_size=192, num_layers=3, num_heads=3, num_kv_heads=3, intermediate_size=384, seed=11),
    "student": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256, seed=12),
}
MODELS["student_warm"] = MODELS["student"]
# SFT overrides per model on top of configs/demo_teacher_sft.yaml.
TRAINING = {
    "teacher": [],
    # A constant learning rate: the warm start is a prefix of a longer run, so its length could be
    # picked from that run's eval curve. 750 steps at 3e-3 teach the format (every answer is three or four
    # digits after the marker) but not the carries: 0.002 on the held-out set. The distillation then
    # continues at the same peak rate (configs/demo_cpu.yaml).
    "student": ["trainer.num_steps=750", "optim.lr=3.0e-3", "optim.lr_decay_style=constant", "optim.min_lr=0",
                "optim.lr_warmup_steps=10", "checkpoint.save_interval=null"],
}
# The demo's student: the same run 50 steps further, where the carries have begun (docs/results.md: from
# the 750-step start the exit from the plateau was a draw of each run; from this one every run left it).
TRAINING["student_warm"] = [*TRAINING["student"], "trainer.num_steps=800"]  # the later override wins


def build_task(out: pathlib.Path) -> pathlib.Path:
    """The demo's task files and tokenizer (deterministic: seed 0)."""
    return arithmetic.build_task(out)


def initial_checkpoint(out: pathlib.Path, name: str, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """A random Qwen3 ``name`` over the task's tokenizer (HF format, tokenizer files beside it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.bos_token_id == tiny.BOS_ID and tokenizer.eos_token_id == tiny.EOS_ID, "special token ids moved"
    directory = tiny.build_checkpoint(out, vocab_size=len(tokenizer), init_std=0.02, **MODELS[name])
    tokenizer.save_pretrained(directory)
    return directory


def sft_command(name: str, init: pathlib.Path, task: pathlib.Path, run_dir: pathlib.Path,
                extra: list[str] = ()) -> list[str]:
    """The torchrun command of ``name``'s SFT run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", TRAINER_CLI, "--config", str(SFT_CONFIG), f"student.checkpoint={init}",
            f"data.train_path={task / 'train.jsonl'}", f"data.eval_path={task / 'eval.jsonl'}",
            f"trainer.output_dir={run_dir}", "logging.progress_bar=false", *TRAINING[name], *extra]


def final_eval(run_dir: pathlib.Path) -> dict:
    """The last eval record of a run's ``metrics.jsonl``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval/accuracy" in r]
    if not evals:
        raise RuntimeError(f"{run_dir}: the run wrote no eval record")
    return evals[-1]


def train(name: str, work: pathlib.Path, dest: pathlib.Path | None, extra: list[str] = (),
          tokenizer=None) -> dict:
    """Builds the task and ``name``'s initial weights under ``work``, trains it with SFT, copies the HF
    export to ``dest`` (when given); returns the final eval record. ``tokenizer(directory)``: writes the
    model's tokenizer there (default: the task's own)."""
    task = build_task(work / "task")
    tokenizer_dir = task / "tokenizer"
    if tokenizer is not None:
        tokenizer_dir = work / "tokenizer"
        tokenizer(tokenizer_dir)
    init = initial_checkpoint(work / f"{name}_init", name, tokenizer_dir)
    run_dir = work / f"{name}_sft"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run: a resumed one would not reproduce the committed tensors
    # A fixed thread count: reductions split over threads sum in another order with another count, and
    # the committed tensors are reproduced bitwise (tests/e2e/test_demo.py).
    env = dict(os.environ, OMP_NUM_THREADS="2")
    subprocess.run(sft_command(name, init, task, run_dir, list(extra)), cwd=REPO, env=env, check=True)
    record = final_eval(run_dir)
    exports = sorted((run_dir / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if dest is not None:
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(exports[-1], dest)
        (dest / "accuracy.json").write_text(json.dumps({"eval/accuracy": record["eval/accuracy"],
                                                         "step": record["step"]}, indent=1) + "\n")
    logger.info("%s: eval accuracy %.3f after %d SFT steps", name, record["eval/accuracy"], record["step"])
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--work", default="outputs/demo_build", help="task files, initial weights, SFT runs")
    parser.add_argument("--dest", default=None, help=f"where the HF export goes (default {ASSETS}/<model>)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides of the SFT run")
    args = parser.parse_intermixed_args(argv)
    setup_logging("INFO")
    dest = pathlib.Path(args.dest) if args.dest else ASSETS / args.model
    train(args.model, pathlib.Path(args.work).resolve(), dest, args.overrides)


if __name__ == "__main__":
    main()
