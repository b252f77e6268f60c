"""The schedulers a run chooses from (``trainer.scheduler``) and what each one does: how far batch production runs
ahead of the update that trains it, and whether its rollouts are partial. Code asks the chosen
:class:`Schedule` (``config.trainer.schedule``), never compares its name.

The pipeline that runs a schedule is :mod:`megatron_gkd.trainer.schedulers` (its docstring has the table of what each
one overlaps); partial rollouts are :mod:`megatron_gkd.config.partial` and :mod:`megatron_gkd.trainer.partial`.
"""

from __future__ import annotations

import dataclasses

from megatron_gkd.registry import Registry


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A scheduler: batches produced ahead of the update that trains them."""

    name: str
    max_staleness: int
    """Batches in flight beyond the one being trained (0: each batch is produced just before its update)."""
    partial: bool = False
    """Partial rollouts: each sample generates at most ``rollout.partial.chunk_tokens`` new tokens a step and an
    unfinished one is carried, with the new weights, into a later step (``rollout.partial``)."""


SCHEDULERS: Registry[Schedule] = Registry("scheduler", config_key="trainer.scheduler")
for _schedule in (Schedule("sync", 0), Schedule("one_step_off", 1), Schedule("two_step_off", 2),
                  Schedule("partial", 0, partial=True), Schedule("partial_one_step_off", 1, partial=True)):
    SCHEDULERS.register(_schedule.name, _schedule)
