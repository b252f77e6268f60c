"""Fault injection into a running trainer (tests and ``benchmarks/fault_injection.py``): every ``every`` steps, SIGKILL
one part of the run, chosen at random: a trainer rank, the rollout server, a teacher replica or the whole teacher
service. Parts are found among the run's processes (the descendants of its torchrun), by their command lines.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import re
import signal
import time

from megatron_gkd.testing import runs

PARTS = {
    "trainer_rank": ("megatron_gkd.trainer.cli",),
    "rollout_server": ("megatron_gkd.rollout.server",),
    "teacher_replica": ("megatron_gkd.teacher.service.cli worker",),
    "teacher_service": ("megatron_gkd.teacher.service.cli serve",),
}
"""Each part and what its processes' command lines hold."""


def descendants(root: int) -> dict[int, str]:
    """``{pid: command line}`` of every live process below ``root``."""
    parents, lines = {}, {}
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            parents[int(proc.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            lines[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = lines[pid]
                frontier.append(pid)
    return found


def part_pids(root: int, part: str) -> list[int]:
    """The live processes of ``part`` in the run under ``root`` (torchrun itself is never a trainer rank)."""
    return sorted(pid for pid, line in descendants(root).items()
                  if any(marker in line for marker in PARTS[part]) and "torch.distributed.run" not in line)


@dataclasses.dataclass
class Kill:
    part: str
    pid: int
    step: int  # the highest step logged when it was killed
    at: float  # time.monotonic()
    log_offset: int = 0  # the run log's length then
    recovered_at: float | None = None  # when a step past ``step`` was first logged
    resumed_from: int | None = None  # where the ranks started again, if they did: their checkpoint's step, or 0

    @property
    def steps_trained_again(self) -> int:
        return 0 if self.resumed_from is None else self.step - self.resumed_from


class FaultInjector:
    """Kills a random part of the run under ``process`` (started by :func:`megatron_gkd.testing.runs.start`) each time
    the run logs ``every`` more steps (steps trained again after a restart do not count) before its last step, once
    the previous kill's run has trained past it.

    Args:
        parts: the parts to choose from; a part with no live process then is skipped for another.
        num_steps: the run's steps (no kill once the last is logged).
        seed: of the choices.
        cycle: kill the parts in the order given, round and round, instead of at random.
    """

    def __init__(self, process, out: pathlib.Path, *, every: int, parts: list[str], num_steps: int, seed: int = 0,
                 cycle: bool = False):
        self.process, self.out, self.every, self.parts = process, out, every, list(parts)
        self.num_steps, self.cycle = num_steps, cycle
        self.random = random.Random(seed)
        self.kills: list[Kill] = []

    def run(self, timeout_s: float) -> int:
        """Injects until the run ends; returns its exit code."""
        end, high = time.monotonic() + timeout_s, 0
        next_kill = self.every
        while self.process.poll() is None:
            if time.monotonic() > end:
                runs.stop(self.process)
                raise AssertionError(f"the run did not end within {timeout_s} s: {runs.tail(self.process)}")
            try:
                steps = [record["step"] for record in runs.steps(self.out)]
            except ValueError:  # a line being written
                steps = []
            logged = max(steps, default=0)
            if logged > high:
                high = logged
                for kill in self.kills:
                    if kill.recovered_at is None and high > kill.step:
                        kill.recovered_at = time.monotonic()
                        kill.resumed_from = self._restarted_from(kill.log_offset)
            if next_kill <= high < self.num_steps and all(kill.recovered_at is not None for kill in self.kills):
                self._kill_one(high)
                next_kill = high + self.every
            time.sleep(0.1)
        return self.process.returncode

    def _restarted_from(self, offset: int) -> int | None:
        """The step the ranks started again from after log position ``offset`` (a new attempt logs "started in"), or
        None if they did not start again."""
        text = self.process.log_path.read_text(errors="replace")[offset:]
        started = text.find("INFO started in ")
        if started < 0:
            return None
        resumed = re.search(r"resumed at step (\d+) ", text[:started])
        return int(resumed.group(1)) if resumed else 0

    def _kill_one(self, step: int) -> None:
        if self.cycle:
            first = len(self.kills) % len(self.parts)
            order = self.parts[first:] + self.parts[:first]
        else:
            order = self.random.sample(self.parts, len(self.parts))
        for part in order:
            pids = part_pids(self.process.pid, part)
            if pids:
                pid = self.random.choice(pids)
                os.kill(pid, signal.SIGKILL)
                offset = len(self.process.log_path.read_text(errors="replace"))
                self.kills.append(Kill(part, pid, step, time.monotonic(), offset))
                return
