"""``--dry-run`` of the 671B preset with ``teacher.signal=hidden`` shows the teacher head shard per student rank.

The student of ``configs/deepseek_v3_671b.yaml`` must share DeepSeek-V3's tokenizer, so the test plans a
Qwen3-8B-class student whose table is DeepSeek-V3's 129,280 rows; the teacher's sizes come from
``configs/hf/deepseek-v3/config.json`` (``teacher.head_checkpoint``, or the served model), no weights.
vLLM cannot return hidden states, so the teacher is a Megatron service (``teacher.serve.backend=megatron``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
PRESET = REPO / "configs" / "deepseek_v3_671b.yaml"
DEEPSEEK_V3 = REPO / "configs" / "hf" / "deepseek-v3"
# DeepSeek-V3's 129,280 x 7,168 table over the preset's student TP of 2: 64,640 rows per rank, bf16.
HIDDEN = ["teacher.signal=hidden", "teacher.serve.backend=megatron",
          "teacher.serve.backend_args={tensor_model_parallel_size: 8, pipeline_model_parallel_size: 2}"]
SHARD_LINE = ("teacher head (hidden signal): teacher table 129280 x 7168 -> [64640, 7168] bf16 per student TP rank "
              "(tp 2) of the last stage = 926,679,040 bytes (0.86 GiB), frozen; loss chunk buffers "
              "~3 x [1024, 64640] fp32 = 0.74 GiB")


@pytest.fixture()
def student(tmp_path) -> pathlib.Path:
    """Qwen3-8B's shape with DeepSeek-V3's vocabulary (the preset's student shares the teacher's tokenizer)."""
    config = json.loads((REPO / "configs" / "hf" / "qwen3-8b" / "config.json").read_text())
    config["vocab_size"] = 129280
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env["MEGATRON_GKD_PYTHON"] = sys.executable
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_pretrain_dry_run_shows_the_head_shard_per_student_rank(student):
    result = _run([sys.executable, "launch/pretrain_gkd.py", "--config", str(PRESET), "--dry-run", "--world-size", "16",
                   *HIDDEN, f"teacher.head_checkpoint={DEEPSEEK_V3}", f"student.checkpoint={student}"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert SHARD_LINE in lines
    assert any(line.startswith("teacher: zmq client") and line.endswith("hidden signal") for line in lines)


def test_pretrain_dry_run_says_why_it_cannot_plan_the_head():
    # The preset's paths are placeholders: the line says which config.json it could not read.
    result = _run([sys.executable, "launch/pretrain_gkd.py", "--config", str(PRESET), "--dry-run", "--world-size", "16",
                   *HIDDEN])
    assert result.returncode == 0, result.stderr
    assert "teacher head (hidden signal): no plan: cannot read the student's config.json" in result.stdout


def test_launcher_dry_run_plans_the_head_and_hands_its_checkpoint_to_the_student(student):
    result = _run(["bash", str(REPO / "launch" / "run_671b.sh"), "--dry-run", "--nodes", "4",
                   f"teacher.serve.model={DEEPSEEK_V3}", f"student.checkpoint={student}",
                   "data.train_path=prompts.jsonl", *HIDDEN])
    assert result.returncode == 0, result.stderr
    memory = result.stdout.split("== memory plan per device")[1].split("== commands")[0]
    assert "  " + SHARD_LINE in memory.splitlines()
    header, row = [line for line in memory.splitlines() if line.strip().startswith(("stage", "0 "))][-2:]
    # Two-word cells ("bwd ws", "4.00 B") joined so that columns line up.
    header, row = header.replace("bwd ws", "bwd-ws").split(), row.replace(" B ", "B ").split()
    columns = dict(zip(header, row))
    assert columns["t-head"] == f"{926_679_040 / 2**30:.2f}" == "0.86"
    assert columns["hid-loss"] == f"{3 * 1024 * 64640 * 4 / 2**30:.2f}" and "top-k" not in columns
    # The combined job drops teacher.serve.model for the student, which still reads the head from it.
    student_command = next(line for line in result.stdout.splitlines() if line.startswith("[student]"))
    assert f"teacher.head_checkpoint={DEEPSEEK_V3}" in student_command
