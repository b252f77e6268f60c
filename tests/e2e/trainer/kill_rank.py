"""The trainer's entry point with one rank that dies: in torchrun's first attempt, rank ``KILL_RANK`` SIGKILLs itself
as it starts to train the step after ``KILL_AFTER_STEP`` completed ones (an OOM kill, a node's fault). Restarted
attempts (``TORCHELASTIC_RESTART_COUNT`` > 0) run as the plain trainer. Test only, started from the repository root:
``torchrun --max-restarts=1 ... -m tests.e2e.trainer.kill_rank --config ... key=value ...``."""

import logging
import os
import signal
import sys

from megatron_gkd.trainer import cli
from megatron_gkd.trainer.loop import Trainer

KILL_RANK = int(os.environ.get("KILL_RANK", "1"))
KILL_AFTER_STEP = int(os.environ["KILL_AFTER_STEP"])
_update = Trainer._update


def update_or_die(self, batch):
    if self.step == KILL_AFTER_STEP and self.rank == KILL_RANK:
        logging.getLogger(__name__).warning("fault injection: SIGKILL to rank %d training step %d", self.rank,
                                            self.step + 1)
        os.kill(os.getpid(), signal.SIGKILL)
    return _update(self, batch)


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        Trainer._update = update_or_die
    sys.exit(cli.main())
