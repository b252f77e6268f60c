"""Preemption: SIGTERM or SIGUSR1 (Slurm's warning before a job's time is up) asks the run to checkpoint after the
step it is in and stop; a second signal stops at once."""

from __future__ import annotations

import logging
import os
import signal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs the handlers; :meth:`requested` tells every rank whether any rank received a signal.

    Args:
        control: a gloo group over every rank.
    """

    def __init__(self, control):
        self.control = control
        self.signal: int | None = None
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        del frame
        if self.signal is not None:  # a second signal: stop now, as without a handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        logger.warning("signal %d received: the run checkpoints and stops after this step (send it again to stop "
                       "at once)", signum)
        self.signal = signum

    def requested(self) -> bool:
        """Whether a rank received a signal (collective over ``control``)."""
        flag = torch.tensor([self.signal or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        if flag.item():
            self.signal = int(flag.item())
        return bool(flag.item())
