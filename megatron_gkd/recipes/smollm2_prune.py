"""The pruning example: SmolLM2-135M-Instruct, a real pretrained chat model from the package index, pruned the
Minitron way to about a third of its size and recovered by on-policy distillation from the full model, on 2 CPU
cores (``bash scripts/run_smollm2_prune.sh``; ``configs/smollm2_prune_cpu.yaml``).

``prepare`` does what the run needs and keeps it under ``--out`` (a rerun reuses it): the teacher (the GGUF from the
package index, dequantized: :mod:`.smollm2`), the prompts (:mod:`.instructions`), the student pruned from the
teacher with the training prompts as calibration text (:mod:`megatron_gkd.prune`), and the teacher's own held-out
accuracy (greedy answers through vLLM, scored as the trainer's eval scores them; the answers, as
``task/eval_teacher.jsonl``, are the reference of ``benchmarks/smollm2_prune.py``'s held-out KL). Two students of about the same
size (63.7M parameters each, of the teacher's 134.5M; the tied embedding is 28.3M of the first, 18.9M of the second):

==========  ======================================================================================================
``depth``   10 of the 30 layers, the ones whose output differs most from their input on the calibration text
``width``   all 30 layers: hidden 576 -> 384 channels, 9 -> 6 query heads (two of three in each key/value group),
            MLP 1536 -> 912 channels, each kept by activation magnitude
==========  ======================================================================================================

``report`` reads the run's metrics and prints the held-out KL to the teacher and the accuracy before and after, and
the share of the gap to the teacher closed, and plots them (``metrics.png``)::

    python -m megatron_gkd.recipes.smollm2_prune prepare --out outputs/smollm2_prune [--variant width]
    python -m megatron_gkd.recipes.smollm2_prune report outputs/smollm2_prune/run --prepared outputs/smollm2_prune
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import subprocess
import sys

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.recipes import greedy, instructions, report
from megatron_gkd.recipes.smollm2 import smollm2_checkpoint
from megatron_gkd.rewards.matching import contains

logger = logging.getLogger(__name__)

VARIANTS = {
    "depth": ["--num-layers", "10"],
    "width": ["--hidden-size", "384", "--num-attention-heads", "6", "--ffn-hidden-size", "912"],
}
"""``python -m megatron_gkd.prune`` sizes of each student (the module docstring's table)."""
EVAL_MAX_TOKENS = 32  # what configs/smollm2_prune_cpu.yaml's eval generates


def prepare(out: pathlib.Path, variant: str = "depth", *, num_samples: int = 64) -> dict:
    """The teacher, the prompts, the ``variant`` student and the teacher's accuracy under ``out``; returns their paths
    (``prepared.json``). Each part is made once: a rerun reuses what exists."""
    out.mkdir(parents=True, exist_ok=True)
    teacher = smollm2_checkpoint()
    task = instructions.build_prompts(out / "task")
    student = out / f"student_{variant}"
    if not student.exists():
        command = [sys.executable, "-m", "megatron_gkd.prune", "--teacher", str(teacher), "--out", str(student),
                   "--calibration", str(task / "train.jsonl"), "--num-samples", str(num_samples), *VARIANTS[variant]]
        logger.info("pruning the %s student: %s", variant, " ".join(command))
        subprocess.run(command, check=True)
    accuracy_path = out / "teacher_accuracy.json"
    if not accuracy_path.exists():
        accuracy, answers = greedy_accuracy(teacher, task / "eval.jsonl")
        records = [json.loads(line) for line in (task / "eval.jsonl").read_text().splitlines() if line.strip()]
        with open(task / "eval_teacher.jsonl", "w") as handle:  # the held-out KL's reference: the teacher's answers
            for record, answer in zip(records, answers, strict=True):
                messages = [*record["messages"], {"role": "assistant", "content": answer}]
                handle.write(json.dumps({**record, "messages": messages}) + "\n")
        accuracy_path.write_text(json.dumps({"eval/accuracy": accuracy}))
    prepared = {"teacher": str(teacher), "task": str(task), "student": str(student), "variant": variant,
                "teacher_accuracy": json.loads(accuracy_path.read_text())["eval/accuracy"]}
    (out / "prepared.json").write_text(json.dumps(prepared, indent=1))
    return prepared


def greedy_accuracy(model: pathlib.Path, eval_path: pathlib.Path) -> tuple[float, list[str]]:
    """``model``'s greedy answers to the held-out prompts through vLLM, scored by ``contains`` as the trainer's eval
    scores the student's (``eval.scorer=contains``, ``eval.max_tokens``); returns the accuracy and the answers."""
    return greedy.greedy_accuracy(model, eval_path, contains, max_tokens=EVAL_MAX_TOKENS, max_model_len=256)


def summarise(run_dir: pathlib.Path, teacher_accuracy_: float, wall_time_s: float | None = None) -> dict:
    """Held-out KL to the teacher and accuracy at the first and last eval, the teacher's accuracy, the share of the
    accuracy gap closed, and the plot."""
    _, evals = report.read_metrics(run_dir)
    first, last = evals[0], evals[-1]
    gap = teacher_accuracy_ - first["eval/accuracy"]
    result = {"kl_before": first["eval/kl_to_teacher"], "kl_after": last["eval/kl_to_teacher"],
              "accuracy_before": first["eval/accuracy"], "accuracy_after": last["eval/accuracy"],
              "teacher_accuracy": teacher_accuracy_, "steps": last["step"], "wall_time_s": wall_time_s,
              "accuracy_gap_closed": (last["eval/accuracy"] - first["eval/accuracy"]) / gap if gap > 0 else None}
    result["plot"] = str(report.plot(run_dir, teacher_accuracy_, scorer="the answer contained").resolve())
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("prepare", help="fetch, build the prompts, prune, measure the teacher")
    made.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs/smollm2_prune"))
    made.add_argument("--variant", choices=sorted(VARIANTS), default="depth")
    shown = commands.add_parser("report", help="the run's figures and plot")
    shown.add_argument("run_dir", type=pathlib.Path)
    shown.add_argument("--prepared", type=pathlib.Path, required=True)
    shown.add_argument("--wall-time", type=float)
    args = parser.parse_args(argv)
    setup_logging("INFO")
    if args.command == "prepare":
        return prepare(args.out, args.variant)
    prepared = json.loads((args.prepared / "prepared.json").read_text())
    result = summarise(args.run_dir, prepared["teacher_accuracy"], args.wall_time)
    closed = "" if result["accuracy_gap_closed"] is None else f" ({result['accuracy_gap_closed']:.0%} of the gap closed)"
    wall = "" if args.wall_time is None else f"; {args.wall_time / 60:.1f} min"
    logger.info("SmolLM2 pruned (%s) and distilled: held-out KL to the teacher %.3f -> %.3f; accuracy %.3f -> %.3f%s, "
                "teacher %.3f, %d steps%s\n  plot  %s", prepared["variant"], result["kl_before"], result["kl_after"],
                result["accuracy_before"], result["accuracy_after"], closed, result["teacher_accuracy"],
                result["steps"], wall, result["plot"])
    return result


if __name__ == "__main__":
    main()
