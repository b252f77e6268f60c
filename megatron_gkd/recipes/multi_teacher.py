"""Reproduces the multi-teacher experiment's second teacher (``assets/multi_teacher/teacher``) with the
trainer's SFT mode, and measures any model's accuracy per task.

The experiment (``benchmarks/multi_teacher.py``) distils the demo's student on two tasks
(:func:`.arithmetic.build_multi_task`): ``add2``, the demo's addition of two numbers, taught by the demo's
teacher (``assets/demo/teacher``), and ``add3``, sums of three numbers in the same format and tokenizer,
taught by this teacher. The demo's teacher has never seen three operands; routing matters only if it
does poorly there, which ``accuracy`` measures.

``teacher``: a random Qwen3 of the demo teacher's shape (3 layers, 192 wide) trained from scratch on the
``add3`` problems by ``torchrun launch/pretrain_gkd.py`` in ``trainer.mode=sft`` with the demo teacher's
recipe (``configs/demo_teacher_sft.yaml``) run longer; its HF export is copied to
``assets/multi_teacher/teacher`` with ``accuracy.json`` (the run's final eval on ``add3`` and the
accuracy on each task's held-out problems). The task files are not committed: they are rebuilt from
the seeds.

    python -m megatron_gkd.recipes.multi_teacher teacher                   # tens of minutes on 2 CPU cores
    python -m megatron_gkd.recipes.multi_teacher accuracy assets/demo/teacher   # held-out accuracy per task
    python -m megatron_gkd.recipes.multi_teacher task --out outputs/multi_teacher_task   # configs/multi_teacher_cpu.yaml's files
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import subprocess

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.recipes import arithmetic, demo, greedy, tiny
from megatron_gkd.rewards.answers import final_answer

logger = logging.getLogger(__name__)

ASSETS = demo.REPO / "assets" / "multi_teacher"
TASK = "add3"  # the task this recipe's teacher learns
# The demo teacher's shape (its own init seed): the same capacity for a task with one more operand.
TEACHER = dict(hidden_size=192, num_layers=3, num_heads=3, num_kv_heads=3, intermediate_size=384, seed=13)
# On top of the demo teacher's SFT recipe: 6000 steps instead of 4000 (two additions to learn, the second
# reading the first's running sum; the cosine decay follows num_steps), and room in eval for the longer
# worked solution (up to 14 tokens and the end).
MAX_TOKENS = 16
TRAINING = ["trainer.num_steps=6000", f"eval.max_tokens={MAX_TOKENS}"]


def build_task(out: pathlib.Path) -> pathlib.Path:
    """The experiment's task files and the demo's tokenizer (deterministic: seeded per task)."""
    return arithmetic.build_multi_task(out)


def initial_checkpoint(out: pathlib.Path, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """A random Qwen3 of :data:`TEACHER`'s shape over the demo's tokenizer (HF format, tokenizer beside it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.bos_token_id == tiny.BOS_ID and tokenizer.eos_token_id == tiny.EOS_ID, "special token ids moved"
    directory = tiny.build_checkpoint(out, vocab_size=len(tokenizer), init_std=0.02, **TEACHER)
    tokenizer.save_pretrained(directory)
    return directory


def task_accuracy(model: str | pathlib.Path, task_dir: pathlib.Path, *,
                  max_tokens: int = MAX_TOKENS) -> dict[str, float]:
    """Greedy accuracy of ``model`` on each task's held-out problems under ``task_dir``, as the trainer's
    eval scores it (vLLM, temperature 0, the ``final_answer`` scorer); one process, no torch.distributed."""
    accuracy = {task: greedy.greedy_accuracy(model, task_dir / task / "eval.jsonl", final_answer,
                                             max_tokens=max_tokens)[0] for task in arithmetic.TASKS}
    logger.info("%s: held-out accuracy %s", model, ", ".join(f"{t} {a:.3f}" for t, a in accuracy.items()))
    return accuracy


def last_export(run_dir: pathlib.Path) -> pathlib.Path:
    """The newest HF export (``hf/step_N``) of a run."""
    return max((run_dir / "hf").glob("step_*"), key=lambda path: int(path.name.split("_")[1]))


def train(work: pathlib.Path, dest: pathlib.Path | None, extra: list[str] = ()) -> dict:
    """Builds the tasks and the initial weights under ``work``, trains the ``add3`` teacher with SFT,
    copies the HF export and ``accuracy.json`` to ``dest`` (when given); returns the final eval record."""
    task = build_task(work / "task")
    init = initial_checkpoint(work / "teacher_init", task / "tokenizer")
    run_dir = work / "teacher_sft"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run: a resumed one would not reproduce the committed tensors
    # The demo's command (its SFT config, one process) on this task's files. A fixed thread count:
    # reductions split over threads sum in another order with another count, and the committed tensors
    # are reproduced bitwise (tests/e2e/test_multi_teacher_assets.py). One thread, not the demo's two: on
    # a machine shared with other jobs two spinning OpenMP threads ran 3.5 s a step against 0.16 s quiet.
    command = demo.sft_command("teacher", init, task / TASK, run_dir, [*TRAINING, *extra])
    subprocess.run(command, cwd=demo.REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    record = demo.final_eval(run_dir)
    logger.info("%s teacher: eval accuracy %.3f after %d SFT steps", TASK, record["eval/accuracy"], record["step"])
    if dest is not None:
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(last_export(run_dir), dest)
        summary = {"eval/accuracy": record["eval/accuracy"], "step": record["step"],
                   "task": TASK, "accuracy_by_task": task_accuracy(dest, task)}
        (dest / "accuracy.json").write_text(json.dumps(summary, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    teacher = commands.add_parser("teacher", help=f"train the {TASK} teacher and copy it to --dest")
    teacher.add_argument("--work", default="outputs/multi_teacher_build", help="task files, initial weights, SFT run")
    teacher.add_argument("--dest", default=str(ASSETS / "teacher"), help="where the HF export goes")
    teacher.add_argument("overrides", nargs="*", help="extra config overrides of the SFT run")
    accuracy = commands.add_parser("accuracy", help="a model's greedy held-out accuracy on each task")
    accuracy.add_argument("model", help="an HF directory with the demo's tokenizer")
    accuracy.add_argument("--work", default="outputs/multi_teacher_build", help="where the task files are built")
    task = commands.add_parser("task", help="only the task files (both tasks, and each alone) and the tokenizer")
    task.add_argument("--out", default="outputs/multi_teacher_task")
    args = parser.parse_args(argv)  # subcommands: parse_intermixed_args refuses them

    setup_logging("INFO")
    if args.command == "teacher":
        train(pathlib.Path(args.work).resolve(), pathlib.Path(args.dest).resolve(), args.overrides)
    elif args.command == "accuracy":
        task_accuracy(args.model, build_task(pathlib.Path(args.work).resolve() / "task"))
    else:
        build_task(pathlib.Path(args.out))


if __name__ == "__main__":
    main()
