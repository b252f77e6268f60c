"""The reward worker: a child process that builds the run's reward once and computes batches of rewards.

Started by :class:`~megatron_gkd.rewards.runner.RewardRunner` as ``python -m megatron_gkd.rewards.worker``
(a module, not a script: nothing of the trainer's ``__main__`` is re-imported, unlike multiprocessing's spawn).
It speaks :mod:`megatron_gkd.rewards.protocol` on stdin/stdout; its own stdout is moved to its stderr first,
so a ``print`` in a user's function reaches the trainer's log instead of corrupting a frame.

**A sandbox whose whole tree dies with it.** The process the runner starts is a supervisor: a subreaper
(:func:`~megatron_gkd.child_process.become_subreaper`) that forks the process which computes the rewards and then
only waits. Whatever the reward starts stays in the supervisor's tree, even a process in a session of its own (as
code-execution graders start theirs) whose parent has exited; when the computing process ends, or the trainer dies
(``PR_SET_PDEATHSIG`` sends the supervisor SIGTERM), the supervisor kills every descendant before it exits. Its main
thread never runs the user's code, so it handles that signal even while a reward spins in C (a catastrophic regular
expression holds the interpreter). The runner kills the same tree from its side on a timeout or at close
(``RewardRunner``). A cgroup would also catch a process that double-forks *and* escapes the subreaper (none can on
Linux without privileges), but needs a writable cgroup tree, which a trainer rarely has.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from megatron_gkd.child_process import become_subreaper, exit_with_parent, kill_descendants
from megatron_gkd.rewards.config import RewardConfig
from megatron_gkd.rewards.kinds import REWARDS, build_reward
from megatron_gkd.rewards.protocol import compute, describe_error, read_frame, write_frame


def _build(setup: dict):
    if setup["kind"] not in REWARDS:  # a plugin kind registered in the trainer's process
        REWARDS.register(setup["kind"], setup["target"])
    logging.disable(logging.WARNING)  # the trainer has logged the section's warnings already
    try:
        config = RewardConfig(**setup["config"])
    finally:
        logging.disable(logging.NOTSET)
    return build_reward(config)


def _stop(signum, frame) -> None:
    try:
        kill_descendants(os.getpid())
    finally:
        os._exit(128 + signum)


def _supervise(compute: int) -> int:
    """Waits for the computing process (reaping the orphans it adopts on the way), then kills what is left of the
    tree and exits as that process did."""
    # The pipes belong to the computing process alone: when it dies, the runner reads the end of its replies.
    os.dup2(os.open(os.devnull, os.O_RDONLY), sys.stdin.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == compute:
            break
    kill_descendants(os.getpid())
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: the runner sees the same
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def main() -> int:
    exit_with_parent()
    become_subreaper()
    signal.signal(signal.SIGTERM, _stop)  # before the fork: no moment without it
    compute = os.fork()
    if compute:
        return _supervise(compute)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    exit_with_parent()  # the supervisor is this process's parent
    return _serve()


def _serve() -> int:
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    setup = read_frame(requests)
    if setup is None:
        return 0
    try:
        reward = _build(setup)
    except Exception as error:  # noqa: BLE001 - reported to the trainer with the reward's name
        write_frame(replies, ("error", describe_error(error)))
        return 1
    write_frame(replies, ("ready", reward.name))
    while (request := read_frame(requests)) is not None:
        write_frame(replies, compute(reward, *request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
