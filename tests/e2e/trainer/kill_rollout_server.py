"""The trainer's entry point with a rollout server that dies mid-rollout: trainer rank 0 SIGKILLs the first rollout
server right after it has sent it generate request ``KILL_AT_REQUEST`` (counted from 1; the server is sampling it, and
its answer never comes). Test only, started from the repository root: ``torchrun ... -m
tests.e2e.trainer.kill_rollout_server --config ... key=value ...``."""

import faulthandler
import logging
import os
import signal
import sys

from megatron_gkd.rollout import remote
from megatron_gkd.trainer import cli
from megatron_gkd.trainer.rollout_server import RemoteRollout

KILL_AT_REQUEST = int(os.environ["KILL_AT_REQUEST"])
_start, _broadcast = RemoteRollout._start, remote._broadcast
servers: list[int] = []  # pids of the rollout servers this rank started
requests = 0


def start_and_remember(self):
    _start(self)
    if self.service is not None:
        servers.append(self.service.process.pid)


def broadcast_then_kill(message, src, group):
    global requests
    received = _broadcast(message, src, group)
    if message is not None and message.get("op") == "generate":
        requests += 1
        if requests == KILL_AT_REQUEST and len(servers) == 1:
            logging.getLogger(__name__).warning("fault injection: SIGKILL to the rollout server (pid %d) sampling "
                                                "request %d", servers[0], requests)
            os.kill(servers[0], signal.SIGKILL)
    return received


if __name__ == "__main__":
    faulthandler.register(signal.SIGRTMIN + 1, all_threads=True)  # a hang's stacks: kill -35 the rank
    if os.environ.get("RANK", "0") == "0":
        RemoteRollout._start = start_and_remember
        remote._broadcast = broadcast_then_kill
    sys.exit(cli.main())
