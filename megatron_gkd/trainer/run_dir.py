"""The run directory (``trainer.output_dir``): the one place that names what a run writes where.

::

    <out>/config.yaml       the resolved config (rank 0, at start-up)
    <out>/train.log         the log (the trainer's command line sets it up)
    <out>/metrics.jsonl     one record per step (and eval), TensorBoard beside it in <out>/tensorboard/
    <out>/checkpoints/      the checkpoint root (:mod:`.checkpoint_dirs`; ``--resume`` and ``resume: auto`` read it)
    <out>/hf/step_N/        HF exports of the student

Tools that read a finished run (the demo's report, the tests' helpers) rely on these names: changing one
changes the project's published layout.
"""

from __future__ import annotations

from pathlib import Path


def root(config) -> Path:
    """The run directory of ``config`` (``trainer.output_dir``)."""
    return Path(config.trainer.output_dir)


def config_file(out: str | Path) -> Path:
    return Path(out) / "config.yaml"


def train_log(out: str | Path) -> Path:
    return Path(out) / "train.log"


def metrics_file(out: str | Path) -> Path:
    return Path(out) / "metrics.jsonl"


def tensorboard_dir(out: str | Path) -> Path:
    return Path(out) / "tensorboard"


def checkpoints(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def hf_export(out: str | Path, step: int) -> Path:
    """Where the HF export of step ``step`` goes."""
    return Path(out) / "hf" / f"step_{step}"
