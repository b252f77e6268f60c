"""Named phase timers, the metrics sinks (JSONL, TensorBoard, wandb) and the rank-0 progress bar.

Only rank 0 writes. ``metrics.jsonl`` holds one line per step with every metric; on resume, lines of
steps after the checkpoint are dropped (and TensorBoard purges them), so the files describe exactly the
steps the model went through.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import pathlib
import sys
import time
from typing import Iterator

from megatron_gkd import platform

logger = logging.getLogger(__name__)


class Timers:
    """Wall time per named phase, synchronised with the device so asynchronous kernels are counted.

    ``with timers("rollout"): ...``; :meth:`pop` returns the seconds per phase since the last call.
    """

    def __init__(self):
        self._elapsed: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        platform.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            platform.synchronize()
            self._elapsed[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        elapsed, self._elapsed = dict(self._elapsed), collections.defaultdict(float)
        return elapsed


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class MetricsWriter:
    """Writes each step's metrics to ``metrics.jsonl``, TensorBoard and (optionally) wandb (rank 0).

    Args:
        output_dir: the run directory.
        config: the ``logging`` section.
        resume_step: the step a resumed run continues after (later records are dropped), or 0.
        run_config: the resolved configuration (for wandb).
    """

    def __init__(self, output_dir: str | pathlib.Path, config, *, resume_step: int = 0, run_config: dict | None = None):
        self.path = pathlib.Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._tensorboard = None
        self._wandb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(pathlib.Path(output_dir) / "tensorboard"),
                                              purge_step=resume_step + 1 if resume_step else None)
        if config.wandb:
            try:
                import wandb
            except ImportError:
                logger.warning("logging.wandb=true but wandb is not installed (`pip install wandb`); logging to "
                               "TensorBoard and metrics.jsonl only")
            else:
                self._wandb = wandb.init(project=config.wandb_project, name=config.wandb_name, config=run_config,
                                         dir=str(output_dir), resume="allow")

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, metrics: dict) -> None:
        """One record: ``{"step": step, **metrics}`` (non-numbers go to the JSONL file only)."""
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
        scalars = {key: float(value) for key, value in metrics.items() if _finite(value)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """A rank-0 progress bar over the run's steps (tqdm on a terminal, a log line per step otherwise)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self._bar = None
        self._enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="distill", unit="step", dynamic_ncols=True)
        self._total = total

    def update(self, step: int, metrics: dict, phases: dict[str, float]) -> None:
        if not self._enabled:
            return
        summary = {"loss": metrics.get("train/loss")}
        summary.update({name: f"{seconds:.2f}s" for name, seconds in phases.items()})
        if self._bar is not None:
            self._bar.set_postfix({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in summary.items()
                                   if v is not None}, refresh=False)
            self._bar.update(1)
        else:
            loss = metrics.get("train/loss")
            logger.info("step %d/%d loss %s | %s", step, self._total, "n/a" if loss is None else f"{loss:.5f}",
                        " ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
