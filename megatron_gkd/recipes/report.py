"""What a demo run shows at its end: a PNG of eval accuracy and loss against steps, and a short summary.

Reads only what a run leaves behind (``metrics.jsonl``, ``hf/``, ``checkpoints/``) and the teacher's
``accuracy.json`` (written by :mod:`.demo` from the teacher's own SFT run, scored by the same evaluator
on the same held-out set)::

    python -m megatron_gkd.recipes.report outputs/demo --teacher assets/demo/teacher --wall-time 812
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

from megatron_gkd.log_setup import setup_logging

logger = logging.getLogger(__name__)


def read_metrics(run_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """``(step records, eval records)`` of a run's ``metrics.jsonl``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "train/loss" in r], [r for r in records if "eval/accuracy" in r]


def plot(run_dir: pathlib.Path, teacher_accuracy: float | None = None, path: pathlib.Path | None = None,
         scorer: str = "exact answer") -> pathlib.Path:
    """Eval accuracy (by ``scorer``, with the teacher's as a line) and train loss against steps, as ``metrics.png``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    steps, evals = read_metrics(run_dir)
    figure, (accuracy_axis, loss_axis) = plt.subplots(1, 2, figsize=(10, 4))
    accuracy_axis.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="student")
    if teacher_accuracy is not None:
        accuracy_axis.axhline(teacher_accuracy, color="gray", linestyle="--", label="teacher")
    accuracy_axis.set(xlabel="step", ylabel=f"eval accuracy ({scorer})", ylim=(0, 1), title="held-out accuracy")
    accuracy_axis.legend()
    loss_axis.plot([r["step"] for r in steps], [r["train/loss"] for r in steps], label="train loss")
    kl = [r for r in evals if "eval/kl_to_teacher" in r]
    if kl:
        loss_axis.plot([r["step"] for r in kl], [r["eval/kl_to_teacher"] for r in kl], "o-", label="eval KL to teacher")
    loss_axis.set(xlabel="step", ylabel="nats per token", title="loss")
    loss_axis.legend()
    figure.tight_layout()
    path = path or run_dir / "metrics.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def summary(run_dir: pathlib.Path, teacher_accuracy: float | None, wall_time_s: float | None) -> dict:
    """Accuracy before -> after, the teacher's, the share of the gap closed, and where the outputs are."""
    steps, evals = read_metrics(run_dir)
    # A run with eval off (eval.at_start, eval.at_end and eval.interval unset) has no accuracy to report.
    before, after = (evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]) if evals else (None, None)
    exports = sorted((run_dir / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    result = {"accuracy_before": before, "accuracy_after": after, "teacher_accuracy": teacher_accuracy,
              "gap_closed": (after - before) / (teacher_accuracy - before)
              if evals and teacher_accuracy is not None and teacher_accuracy > before else None,
              "steps": max((r["step"] for r in steps + evals), default=0), "wall_time_s": wall_time_s,
              "checkpoint": str((run_dir / "checkpoints").resolve()),
              "hf_export": str(exports[-1].resolve()) if exports else None}
    return result


def teacher_accuracy(teacher_dir: pathlib.Path | None) -> float | None:
    if teacher_dir is None or not (teacher_dir / "accuracy.json").exists():
        return None
    return float(json.loads((teacher_dir / "accuracy.json").read_text())["eval/accuracy"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--teacher", help="the teacher's directory (its accuracy.json)")
    parser.add_argument("--wall-time", type=float, help="seconds the run took, as the caller measured them")
    args = parser.parse_args(argv)

    setup_logging("INFO")
    run_dir = pathlib.Path(args.run_dir)
    reference = teacher_accuracy(pathlib.Path(args.teacher) if args.teacher else None)
    result = summary(run_dir, reference, args.wall_time)
    result["plot"] = str(plot(run_dir, reference).resolve())
    teacher = "unknown" if reference is None else f"{reference:.3f}"
    closed = "" if result["gap_closed"] is None else f" ({result['gap_closed']:.0%} of the gap to the teacher closed)"
    wall = "" if args.wall_time is None else f"\n  wall time   {args.wall_time / 60:.1f} min"
    accuracy = ("no eval ran (eval.at_start, eval.at_end and eval.interval are off)" if result["accuracy_before"] is None
                else f"eval accuracy {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}")
    logger.info(f"distillation demo: {accuracy} in {result['steps']} steps{closed}; teacher {teacher}{wall}\n"
          f"  checkpoint  {result['checkpoint']}\n  HF export   {result['hf_export']}\n  plot        {result['plot']}")
    return result


if __name__ == "__main__":
    main()
