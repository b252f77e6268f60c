"""Every launch script's ``--dry-run`` on this machine (no Slurm): nodes, ranks, commands, memory plan."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
HF = REPO / "configs" / "hf"
TINY = REPO / "configs" / "cpu_tiny.yaml"
PLANNABLE = [f"student.checkpoint={HF / 'qwen3-8b'}", "data.train_path=prompts.jsonl"]


def dry_run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env["MEGATRON_GKD_PYTHON"] = sys.executable
    return subprocess.run(["bash", str(REPO / script), "--dry-run", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


def test_run_671b_chooses_two_teacher_nodes_and_prints_the_plan():
    result = dry_run("launch/run_671b.sh", "--nodes", "4", f"teacher.serve.model={HF / 'deepseek-v3'}", *PLANNABLE)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The planner's choice: FP8 DeepSeek-V3 does not fit one 8 x H100 node beside its workspace.
    assert "vLLM TP8 PP2, fp8 weights" in out
    assert "TP8 PP1: stage 0: weights 79.3" in out
    assert "vllm backend serving" in out and "on 2 node(s) x 8 process(es): node0, node1" in out
    assert "student on 2 node(s) x 8 process(es): node2, node3" in out
    assert "world 16 = tp 2 x pp 1 x dp 8" in out and "rank 15: tp 1 dp 7 pp 0" in out
    commands = out.split("== commands, in order")[1]
    lines = commands.strip().splitlines()
    assert lines[0].startswith("[ray-head] on node0:") and "--head --port=6379" in lines[0] and "--num-gpus=8" in lines[0]
    assert lines[1].startswith("[ray-workers] on node1:") and "--address=node0:6379" in lines[1]
    assert lines[2].startswith("[wait] until Ray at node0:6379 lists 2 node(s)") and "--tp=8 --pp=2" in lines[2]
    assert lines[3].startswith("[teacher] on node0: RAY_ADDRESS=node0:6379")
    for flag in ("tensor_parallel_size=8", "pipeline_parallel_size=2", "distributed_executor_backend=ray",
                 "--frontend=tcp://0.0.0.0:5555", "--secret-file="):
        assert flag in lines[3]
    student = next(line for line in lines if line.startswith("[student]"))
    for flag in ("--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node2:29400",
                 "teacher.serve.model=null", "teacher.address=tcp://node0:5555", "teacher.secret_file="):
        assert flag in student
    memory = out.split("== memory plan per device")[1]
    assert "device h100-80gb" in memory and "layout: TP2 PP1 DP8 SP distopt" in memory and ": fits" in memory
    assert "scontrol requeue" in out


def test_student_sbatch_dry_run_has_the_c10d_rendezvous_ranks_and_memory_plan():
    result = dry_run("launch/slurm/student.sbatch", "--nodes", "2", "--nproc-per-node", "4", "--device", "h100-80gb",
                     "--config", str(TINY), *PLANNABLE, "teacher.serve.model=teacher_dir", "rollout.tensor_parallel_size=4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "allocation: 2 node(s) x 4 process(es): node0, node1 [dry-run]" in out
    assert "node node0: ranks 0-3" in out and "node node1: ranks 4-7" in out
    assert "rank 7: tp 1 dp 3 pp 0" in out
    student = next(line for line in out.splitlines() if line.startswith("[student] on node0,node1:"))
    assert "--rdzv-backend=c10d --rdzv-endpoint=node0:29400" in student
    assert f"--config={TINY}" in student and "rollout.tensor_parallel_size=4" in student
    # A rank that dies: torchrun restarts the ranks (issue #48 item 3), each attempt with a store of its own.
    assert "--max-restarts=3" in student and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in student
    assert "at most 3 time(s)" in out.split("== a rank that dies")[1]
    assert "layout: TP2 PP1 DP4" in out and "fullest rank" in out
    assert "[teacher]" not in out


def test_max_restarts_0_fails_the_job_with_its_first_rank():
    result = dry_run("launch/slurm/student.sbatch", "--nodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
                     "--config", str(TINY), *PLANNABLE, "teacher.serve.model=teacher_dir")
    assert result.returncode == 0, result.stderr
    student = next(line for line in result.stdout.splitlines() if line.startswith("[student]"))
    assert "--max-restarts=0" in student and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in student
    assert "the job fails with it" in result.stdout.split("== a rank that dies")[1]


def test_teacher_sbatch_dry_run_puts_megatron_rank_0_on_the_first_node():
    result = dry_run("launch/slurm/teacher.sbatch", "--nodes", "2", "--nproc-per-node", "2", "--config", str(TINY),
                     *PLANNABLE, "teacher.serve.model=teacher_dir", "teacher.serve.backend=megatron",
                     "teacher.serve.backend_args={tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("== commands, in order")[1].strip().splitlines()
    assert lines[0].startswith("[teacher-0] on node0:") and lines[1].startswith("[teacher-1] on node1:")
    for rank, line in enumerate(lines[:2]):
        assert f"--node-rank={rank} --master-addr=node0 --master-port=29500" in line
        assert "-m megatron_gkd.teacher.service.cli serve --frontend=tcp://0.0.0.0:5555 --backend=megatron" in line
    assert "the planner models vLLM teachers" in result.stdout
    assert "[student]" not in result.stdout


def test_combined_sbatch_dry_run_splits_the_nodes():
    result = dry_run("launch/slurm/combined.sbatch", "--nodes", "3", "--nproc-per-node", "2", "--teacher-nodes", "1",
                     "--config", str(TINY), *PLANNABLE, "teacher.serve.model=teacher_dir")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "hf backend serving teacher_dir on 1 node(s) x 2 process(es): node0" in out
    student = next(line for line in out.splitlines() if line.startswith("[student] on node1,node2:"))
    assert "--rdzv-endpoint=node1:29400" in student and "teacher.address=tcp://node0:5555" in student


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2", "--teacher-nodes", "2"], "keep at least one for the student"),
    (["--nodes", "3", "--teacher-nodes", "2"], "runs in one process on one node"),
])
def test_layouts_that_cannot_work_exit_2_with_the_fix(args, message):
    result = dry_run("launch/slurm/combined.sbatch", *args, "--nproc-per-node", "2", "--config", str(TINY),
                     *PLANNABLE, "teacher.serve.model=teacher_dir")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("config error:") and message in result.stderr
