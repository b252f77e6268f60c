"""One logging setup for every entry point: rank-aware, optionally mirrored to a file.

Under torchrun every rank logs; without care N ranks print N copies of each line. Rank 0 logs at the
requested level, the other ranks only warnings and errors (they still report their own failures), and
each line carries its rank when there is more than one::

    setup_logging("INFO")                                   # first thing in main()
    setup_logging("INFO", log_file=out / "train.log")       # the trainer: also into the run directory
"""

from __future__ import annotations

import logging
import os
import pathlib

FORMAT = "%(asctime)s %(rank_prefix)s%(name)s %(levelname)s %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self._prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = self._prefix
        return True


def env_rank() -> tuple[int, int]:
    """``(rank, world_size)`` from the launcher's environment (torchrun, Slurm), ``(0, 1)`` without one."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    return rank, world


def setup_logging(level: str | int = "INFO", *, all_ranks: bool = False,
                  log_file: str | os.PathLike | None = None) -> None:
    """Configures the root logger once for this process (replacing earlier handlers).

    Args:
        level: the level of rank 0 (and of every rank with ``all_ranks``).
        all_ranks: every rank logs at ``level`` (debugging); otherwise ranks > 0 log warnings only.
        log_file: also append this rank's lines to this file (rank 0 only unless ``all_ranks``).
    """
    rank, world = env_rank()
    level = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(level, int):
        raise ValueError(f"logging level {level!r} is not one of DEBUG, INFO, WARNING, ERROR")
    effective = level if rank == 0 or all_ranks else max(level, logging.WARNING)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None and (rank == 0 or all_ranks):
        path = pathlib.Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    prefix = f"[rank {rank}] " if world > 1 else ""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        handler.addFilter(_RankFilter(prefix))
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(effective)
