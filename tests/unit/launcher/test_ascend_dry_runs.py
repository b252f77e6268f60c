"""The Ascend launch scripts' ``--dry-run`` on this machine: the npu platform for every process, and a
memory plan per NPU (Atlas 800T A2: 8 x 910B, 64 GB HBM each)."""

from __future__ import annotations

import subprocess

import pytest

from tests.unit.launcher.test_dry_runs import HF, REPO, dry_run

PLANNABLE = ["data.train_path=prompts.jsonl"]


def _memory(out: str) -> str:
    return out.split("== memory plan per device")[1].split("== commands")[0]


def test_qwen3_dense_fits_one_atlas_node():
    result = dry_run("launch/ascend/qwen3_dense.sbatch", "--nodes", "1", f"student.checkpoint={HF / 'qwen3-8b'}", *PLANNABLE)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "allocation: 1 node(s) x 8 process(es)" in out
    assert "configs/ascend_qwen3_dense.yaml" in out
    memory = _memory(out)
    assert "device ascend-910b-64gb (64 GiB)" in memory
    assert "layout: TP4 PP1 DP2 SP distopt recompute=full" in memory
    assert "GiB of 60.00 GiB usable on ascend-910b-64gb: fits" in memory


def test_qwen3_moe_on_two_atlas_nodes_spreads_experts():
    result = dry_run("launch/ascend/qwen3_moe.sbatch", "--nodes", "2", f"student.checkpoint={HF / 'qwen3-30b-a3b'}",
                     *PLANNABLE)
    assert result.returncode == 0, result.stderr
    memory = _memory(result.stdout)
    assert "Qwen3MoeForCausalLM" in memory and "layout: TP1 PP1 EP8 DP16 distopt" in memory
    assert "usable on ascend-910b-64gb: fits" in memory


def test_deepseek_v3_teacher_takes_four_atlas_nodes_in_bf16():
    result = dry_run("launch/ascend/run_671b.sh", "--nodes", "6", f"teacher.serve.model={HF / 'deepseek-v3'}",
                     f"student.checkpoint={HF / 'qwen3-8b'}", *PLANNABLE)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # No FP8 matmuls on 910B: bf16 weights need 4 nodes of 8 x 64 GB (TP8 PP4).
    assert "vLLM TP8 PP4, bf16 weights" in out
    assert "served in bf16 on ascend-910b-64gb (no FP8 matmuls)" in out
    assert "on 4 node(s) x 8 process(es): node0, node1, node2, node3" in out
    assert "student on 2 node(s) x 8 process(es): node4, node5" in out
    memory = _memory(out)
    assert "device ascend-910b-64gb (64 GiB)" in memory
    assert memory.count("total GiB") == 2  # one table for the teacher's stages, one for the student
    assert "usable on ascend-910b-64gb: fits" in memory


def test_910c_dies_are_planned_as_sixteen_devices_per_node():
    result = dry_run("launch/ascend/qwen3_dense.sbatch", "--nodes", "1", "--nproc-per-node", "16", "--device",
                     "ascend-910c-die-64gb", f"student.checkpoint={HF / 'qwen3-8b'}", *PLANNABLE)
    assert result.returncode == 0, result.stderr
    assert "allocation: 1 node(s) x 16 process(es)" in result.stdout
    assert "device ascend-910c-die-64gb (64 GiB)" in _memory(result.stdout)


@pytest.mark.parametrize("script", ["qwen3_dense.sbatch", "qwen3_moe.sbatch", "run_671b.sh"])
def test_scripts_run_the_job_on_the_npu_platform(script, tmp_path):
    # The launcher in the script's place prints the environment it is started with.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\necho \"PLATFORM=$MEGATRON_GKD_PLATFORM ALLOC=$PYTORCH_NPU_ALLOC_CONF\"\n")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "MEGATRON_GKD_PYTHON": str(fake)}
    result = subprocess.run(["bash", str(REPO / "launch" / "ascend" / script), "--dry-run"], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "PLATFORM=npu ALLOC=expandable_segments:True" in result.stdout
