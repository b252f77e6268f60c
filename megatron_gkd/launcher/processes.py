"""Starting a job's steps on their nodes and stopping them: ``srun`` inside a Slurm job, plain child
processes on one machine.

Preemption signals reach every process of a step: ``srun`` forwards SIGUSR1 to all the processes of
the step (as Slurm does with SIGTERM on a cancel or the time limit), and a local step leads its own
process group, which is signalled whole. The trainer ranks catch them (checkpoint after the step, exit
0, a second signal stops at once). ``torchrun`` must let its ranks finish: it would die of SIGUSR1, and
on SIGTERM it would send its ranks a second SIGTERM and kill them 30 s later. So every task starts with
SIGUSR1 ignored, and the trainer's task also with SIGTERM ignored and left out of torchrun's handled
signals (``TORCHELASTIC_SIGNALS_TO_HANDLE``); ignored signals stay ignored through exec, and the
trainer installs its own handlers for both.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess

from megatron_gkd.launcher.commands import Step

logger = logging.getLogger(__name__)

# `bash -c SCRIPT NAME ARGS...`: ignore the signals, then become the command.
_IGNORE_USR1 = ["bash", "-c", 'trap "" USR1; exec "$@"', "gkd-task"]
_IGNORE_USR1_TERM = ["bash", "-c", 'trap "" USR1 TERM; exec "$@"', "gkd-trainer"]
TORCHRUN_SIGNALS = {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGINT,SIGHUP,SIGQUIT"}


def wrapped(step: Step) -> list[str]:
    """The step's command behind the signal dispositions it needs (see the module's docstring)."""
    return (_IGNORE_USR1_TERM if step.signal_target else _IGNORE_USR1) + step.command


class Running:
    """A started step: its launcher process (``srun`` or the local command) and how to signal it."""

    def __init__(self, step: Step, process: subprocess.Popen, group: bool):
        self.step, self.process, self._group = step, process, group

    @property
    def name(self) -> str:
        return self.step.name

    def poll(self) -> int | None:
        return self.process.poll()

    def send_signal(self, signum: int) -> None:
        """Delivers ``signum`` to every process of the step."""
        if self.process.poll() is not None:
            return
        try:
            if self._group:
                os.killpg(self.process.pid, signum)
            else:  # srun forwards it to all the step's processes on every node
                self.process.send_signal(signum)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to every process of the step, SIGKILL after ``timeout_s``; returns the exit code."""
        self.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("step %s did not stop within %.0f s of SIGTERM; killing it", self.name, timeout_s)
            self.send_signal(signal.SIGKILL)
            self.process.kill()
            self.process.wait()
        if self._group:  # children that outlived the step's leader
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return self.process.returncode


class Executor:
    """Starts steps; ``log_dir`` receives the output of steps that are not the trainer's."""

    own_process_group = False
    """Each step leads its own process group, signalled whole (local); else srun relays signals."""

    def __init__(self, log_dir: pathlib.Path):
        self.log_dir = log_dir

    def command(self, step: Step) -> list[str]:
        raise NotImplementedError

    def start(self, step: Step) -> Running:
        env = dict(os.environ, **step.env, **(TORCHRUN_SIGNALS if step.signal_target else {}))
        log = None
        if not step.signal_target:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{step.name}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            process = subprocess.Popen(self.command(step), env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                       start_new_session=self.own_process_group)
        finally:
            if log is not None:
                log.close()
        logger.info("started %s (pid %d)%s", step.describe(), process.pid,
                    f"; log {self.log_dir / (step.name + '.log')}" if log else "")
        return Running(step, process, group=self.own_process_group)


class SlurmExecutor(Executor):
    """Steps are ``srun`` job steps on the named nodes, one task each, sharing the nodes (``--overlap``)."""

    def command(self, step: Step) -> list[str]:
        count = len(step.nodes)
        args = ["srun", f"--job-name={step.name}", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
                f"--nodelist={','.join(node.name for node in step.nodes)}", "--overlap", "--kill-on-bad-exit=1"]
        # srun no longer inherits --cpus-per-task from sbatch (Slurm 22.05+): pass it on.
        if os.environ.get("SLURM_CPUS_PER_TASK"):
            args.append(f"--cpus-per-task={os.environ['SLURM_CPUS_PER_TASK']}")
        return args + wrapped(step)


class LocalExecutor(Executor):
    """Steps are child processes of this machine, each leading its own process group."""

    own_process_group = True

    def command(self, step: Step) -> list[str]:
        return wrapped(step)
