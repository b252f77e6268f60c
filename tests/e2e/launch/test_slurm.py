"""The Slurm scripts under a real Slurm (Debian's packages, two virtual nodes on this machine): the
student job trains over two nodes (srun + torchrun c10d), the teacher job serves a Megatron teacher
under torchrun over two nodes and a student job trains against it, and a preemption signal
(``scancel --signal=USR1 --batch``, what ``#SBATCH --signal=B:USR1@...`` sends) makes the trainer
checkpoint, the job requeue itself and the requeued job resume to the end."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

from tests.e2e.launch.slurm_cluster import SlurmCluster

REPO = pathlib.Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "cpu_tiny.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="starts Slurm daemons: needs root")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_assets

    return build_assets(tmp_path_factory.mktemp("tiny_assets"))


def overrides(assets: pathlib.Path, out: pathlib.Path, *extra: str) -> list[str]:
    return ["--nproc-per-node", "1", "--kernels", "local", "--config", str(CONFIG),
            f"student.checkpoint={assets / 'student'}", f"teacher.serve.model={assets / 'teacher'}",
            f"data.train_path={assets / 'train.jsonl'}", f"data.eval_path={assets / 'eval.jsonl'}",
            f"trainer.output_dir={out}", "logging.progress_bar=false", "eval.at_start=false", *extra]


def submit(cluster, script: str, log: pathlib.Path, args: list[str]) -> str:
    env = {"MEGATRON_GKD_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return cluster.submit([f"--output={log}", "--nodes=2", str(REPO / script), *args], cwd=REPO, env=env)


def steps(out: pathlib.Path) -> list[int]:
    path = out / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [record["step"] for record in records if "train/loss" in record]


def finished(cluster, job_id: str, log: pathlib.Path, timeout_s: float = 900) -> dict:
    fields = cluster.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout_s)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, log.read_text()[-4000:])
    return fields


def test_student_job_trains_over_two_nodes(cluster, assets, tmp_path):
    out, log = tmp_path / "student", tmp_path / "student.out"
    job = submit(cluster, "launch/slurm/student.sbatch", log, overrides(assets, out, "trainer.num_steps=2"))
    finished(cluster, job, log)
    text = log.read_text()
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400" in text
    assert steps(out) == [1, 2]


def test_teacher_job_serves_a_student_job_and_stops_on_the_signal(cluster, assets, tmp_path):
    teacher_out, teacher_log = tmp_path / "teacher", tmp_path / "teacher.out"
    teacher_args = overrides(assets, teacher_out, "teacher.serve.backend=megatron",
                             "teacher.serve.backend_args={tensor_model_parallel_size: 2}")
    teacher = submit(cluster, "launch/slurm/teacher.sbatch", teacher_log, teacher_args)
    address_file, secret_file = teacher_out / "launch" / "teacher_address", teacher_out / "launch" / "teacher.secret"
    deadline = time.monotonic() + 600
    while not address_file.exists():
        assert time.monotonic() < deadline, teacher_log.read_text()[-4000:]
        assert cluster.job(teacher)["JobState"] in ("PENDING", "RUNNING"), teacher_log.read_text()[-4000:]
        time.sleep(2)
    address = address_file.read_text().strip()
    assert address == "tcp://127.0.0.1:5555"
    student_out, student_log = tmp_path / "student", tmp_path / "student.out"
    student = submit(cluster, "launch/slurm/student.sbatch", student_log, overrides(
        assets, student_out, "trainer.num_steps=2", "--rdzv-port", "29410", "teacher.serve.model=null",
        f"teacher.address={address}", f"teacher.secret_file={secret_file}"))
    finished(cluster, student, student_log)
    assert steps(student_out) == [1, 2]
    assert not (student_out / "teacher_service.log").exists()  # it used the teacher job's service
    cluster.run("scancel", "--signal=USR1", "--batch", teacher)
    finished(cluster, teacher, teacher_log, timeout_s=180)
    text = teacher_log.read_text()
    assert "--node-rank=0" in text and "--node-rank=1" in text and "teacher service stopping after SIGUSR1" in text


def test_preemption_checkpoints_requeues_and_resumes(cluster, assets, tmp_path):
    out, log = tmp_path / "preempted", tmp_path / "preempted.out"
    job = submit(cluster, "launch/slurm/student.sbatch", log, overrides(assets, out, "trainer.num_steps=6",
                                                                          "--rdzv-port", "29420"))
    deadline = time.monotonic() + 600
    while not steps(out):
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), log.read_text()[-4000:]
        time.sleep(1)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    fields = finished(cluster, job, log, timeout_s=1200)
    assert fields["Restarts"] == "1"
    text = log.read_text()
    assert '"preempted": true' in text and "requeueing job" in text
    assert steps(out) == [1, 2, 3, 4, 5, 6]  # every step once: the requeued run resumed, it did not restart
    assert "resumed at step" in text


def test_combined_job_splits_its_nodes_and_stops_the_teacher(cluster, assets, tmp_path):
    out, log = tmp_path / "combined", tmp_path / "combined.out"
    args = overrides(assets, out, "trainer.num_steps=2", "--teacher-nodes", "1", "--teacher-port", "5575",
                     "--rdzv-port", "29430")
    args[args.index("--nproc-per-node") + 1] = "2"  # the student: TP=2 on its one node
    job = submit(cluster, "launch/slurm/combined.sbatch", log, args)
    finished(cluster, job, log)
    text = log.read_text()
    assert "started [teacher] on n1" in text and "started [student] on n2" in text
    assert "TEACHER READY tcp://127.0.0.1:5575 (hf)" in text and steps(out) == [1, 2]
    assert "address: tcp://127.0.0.1:5575" in (out / "config.yaml").read_text()
    assert str(out) not in cluster.run("ps", "-eo", "args")  # the teacher and the trainer are gone
