"""The launcher's run-time, with stand-in processes: a preemption signal reaches the trainer through a
parent that ignores SIGUSR1 (as torchrun must), the job asks Slurm to requeue itself, and a teacher
step that dies stops the student."""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import time

import pytest

from megatron_gkd.launcher import runner
from megatron_gkd.launcher.commands import Step
from megatron_gkd.launcher.nodes import Allocation, local_allocation
from megatron_gkd.launcher.plan import JobOptions, JobPlan
from megatron_gkd.launcher.processes import LocalExecutor, SlurmExecutor

FAKE_TRAINER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
stop = []
for signum in (signal.SIGUSR1, signal.SIGTERM):  # as the trainer: checkpoint after the step, exit 0
    signal.signal(signum, lambda *_: stop.append(1))
out.joinpath("ready").write_text("")
for step in range(600):
    if stop:
        out.joinpath("checkpointed").write_text(str(step))
        sys.exit(0)
    time.sleep(0.05)
sys.exit(3)
"""


def plan_with(student: Step | None, tmp_path: pathlib.Path, allocation: Allocation) -> JobPlan:
    options = JobOptions(role="student", config_path=None, overrides=[], launch_dir=tmp_path / "launch")
    return JobPlan(options=options, allocation=allocation, teacher=None, teacher_allocation=None, student=student,
                   student_allocation=allocation, student_overrides=[], student_config=None, sections=[])


def trainer_step(tmp_path: pathlib.Path) -> Step:
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    # The middle bash stands for torchrun: it must outlive SIGUSR1 and report its child's exit code.
    return Step(name="student", nodes=local_allocation(1).nodes, signal_target=True,
                command=["bash", "-c", f"{sys.executable} {script} {tmp_path}; code=$?; echo alive > "
                         f"{tmp_path}/parent_alive; exit $code"])


def signal_when_ready(tmp_path: pathlib.Path, signum: int) -> threading.Thread:
    def send():
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_preemption_reaches_the_trainer_through_a_parent_that_ignores_it(tmp_path):
    job = runner.Job(plan_with(trainer_step(tmp_path), tmp_path, local_allocation(1)), LocalExecutor(tmp_path))
    before = signal.getsignal(signal.SIGUSR1)
    signal_when_ready(tmp_path, signal.SIGUSR1)
    assert job.run() == 0
    assert (tmp_path / "checkpointed").exists() and (tmp_path / "parent_alive").exists()
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers restored


def test_a_preempted_slurm_job_requeues_itself(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner.subprocess, "run", lambda args, **kwargs: calls.append(args))
    slurm = Allocation(nodes=local_allocation(1).nodes, nproc_per_node=1, scheduler="slurm", job_id="42")
    job = runner.Job(plan_with(trainer_step(tmp_path), tmp_path, slurm), LocalExecutor(tmp_path))
    signal_when_ready(tmp_path, signal.SIGUSR1)
    assert job.run() == 0
    assert calls == [["scontrol", "requeue", "42"]]


def test_sigterm_on_one_machine_checkpoints_through_torchrun_without_a_requeue(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner.subprocess, "run", lambda args, **kwargs: calls.append(args))
    job = runner.Job(plan_with(trainer_step(tmp_path), tmp_path, local_allocation(1)), LocalExecutor(tmp_path))
    signal_when_ready(tmp_path, signal.SIGTERM)
    assert job.run() == 0
    assert (tmp_path / "checkpointed").exists() and (tmp_path / "parent_alive").exists() and calls == []


def test_no_requeue_without_a_signal(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner.subprocess, "run", lambda args, **kwargs: calls.append(args))
    slurm = Allocation(nodes=local_allocation(1).nodes, nproc_per_node=1, scheduler="slurm", job_id="42")
    step = Step(name="student", nodes=slurm.nodes, command=["true"], signal_target=True)
    assert runner.Job(plan_with(step, tmp_path, slurm), LocalExecutor(tmp_path)).run() == 0
    assert calls == []


def test_a_dead_teacher_step_stops_the_student(tmp_path):
    job = runner.Job(plan_with(trainer_step(tmp_path), tmp_path, local_allocation(1)), LocalExecutor(tmp_path))
    job.running.append(LocalExecutor(tmp_path).start(Step(name="teacher", nodes=local_allocation(1).nodes,
                                                          command=["bash", "-c", "sleep 1; exit 7"])))
    started = time.monotonic()
    assert job.run() == 1
    assert time.monotonic() - started < 20 and (tmp_path / "checkpointed").exists()
    assert (tmp_path / "teacher.log").exists()


def test_srun_steps_name_their_nodes_and_ignore_usr1_before_exec(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    nodes = Allocation(nodes=tuple(local_allocation(1).nodes) * 1, nproc_per_node=8, scheduler="slurm").nodes
    command = SlurmExecutor(tmp_path).command(Step(name="teacher", nodes=nodes, command=["python", "x.py"]))
    assert command[:9] == ["srun", "--job-name=teacher", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                           "--nodelist=localhost", "--overlap", "--kill-on-bad-exit=1", "--cpus-per-task=16"]
    assert command[9:] == ["bash", "-c", 'trap "" USR1; exec "$@"', "gkd-task", "python", "x.py"]
    trainer = SlurmExecutor(tmp_path).command(Step(name="student", nodes=nodes, command=["x"], signal_target=True))
    assert trainer[9:] == ["bash", "-c", 'trap "" USR1 TERM; exec "$@"', "gkd-trainer", "x"]


def test_wait_for_teacher_gives_up_when_a_step_dies(tmp_path):
    runner.write_secret(tmp_path / "secret")
    assert oct((tmp_path / "secret").stat().st_mode & 0o777) == "0o600"

    def check():
        raise RuntimeError("step teacher exited with code 1")

    with pytest.raises(RuntimeError, match="exited with code 1"):
        runner.wait_for_teacher("tcp://127.0.0.1:1", tmp_path / "secret", 30, check)
