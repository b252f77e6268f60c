"""Preemption: SIGTERM or SIGUSR1 (Slurm's warning before a job's time is up) asks the run to checkpoint after the
step it is in and stop; a second signal stops at once.

One request often arrives twice: a kill of the job's processes (``scancel``, ``kill`` of a process group, a container
stop) reaches each rank directly and through torchrun, which forwards SIGTERM to its workers within milliseconds. So a
signal within :data:`SAME_REQUEST_S` of the rank's first is the same request, not the second that stops at once (that
took a run's checkpoint: one rank stopped at once, the other's save waited on it). A rank that learnt of the request
from another (:meth:`Preemption.requested`) has not received one itself: its own first signal is a first.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAME_REQUEST_S = 1.0
"""Seconds after a rank's first signal within which another is the same request delivered again."""


class Preemption:
    """Installs the handlers; :meth:`requested` tells every rank whether any rank received a signal.

    Args:
        control: a gloo group over every rank.
    """

    def __init__(self, control):
        self.control = control
        self.signal: int | None = None
        self._received_at: float | None = None  # this rank's first signal (time.monotonic)
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        del frame
        now = time.monotonic()
        if self._received_at is not None and now - self._received_at > SAME_REQUEST_S:
            signal.signal(signum, signal.SIG_DFL)  # a second signal: stop now, as without a handler
            os.kill(os.getpid(), signum)
            return
        if self._received_at is not None:
            logger.info("signal %d again %.3f s after the first: the same request (a launcher forwards what its "
                        "process group received); send it again later to stop at once", signum,
                        now - self._received_at)
            return
        logger.warning("signal %d received: the run checkpoints and stops after this step (send it again to stop "
                       "at once)", signum)
        self._received_at = now
        self.signal = signum

    def requested(self) -> bool:
        """Whether a rank received a signal (collective over ``control``)."""
        flag = torch.tensor([self.signal or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        if flag.item():
            self.signal = int(flag.item())
        return bool(flag.item())
