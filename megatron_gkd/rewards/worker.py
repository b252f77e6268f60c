"""The reward worker: a child process that builds the run's reward once and computes batches of rewards.

Started by :class:`~megatron_gkd.rewards.runner.RewardRunner` as ``python -m megatron_gkd.rewards.worker``
(a module, not a script: nothing of the trainer's ``__main__`` is re-imported, unlike multiprocessing's spawn).
It speaks :mod:`megatron_gkd.rewards.protocol` on stdin/stdout; its own stdout is moved to its stderr first,
so a ``print`` in a user's function reaches the trainer's log instead of corrupting a frame.
"""

from __future__ import annotations

import logging
import os
import sys

from megatron_gkd.child_process import exit_with_parent
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


def main() -> int:
    exit_with_parent()
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
