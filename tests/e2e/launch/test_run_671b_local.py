"""``launch/run_671b.sh`` on one CPU machine, for real: the launcher starts the teacher service (a tiny
DeepSeek-V3 on the hf backend), waits until it answers, trains a TP=2 student against it over ZMQ with
the shared secret, and stops everything when training ends."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.e2e.launch.assets import build_deepseek_flow_assets

REPO = pathlib.Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (this test's unique directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


def test_run_671b_runs_the_whole_flow_on_one_cpu_machine(tmp_path):
    assets = build_deepseek_flow_assets(tmp_path / "assets")
    out = tmp_path / "run"
    env = dict(os.environ, MEGATRON_GKD_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env = {key: value for key, value in env.items() if not key.startswith("SLURM_")}
    command = ["bash", str(REPO / "launch" / "run_671b.sh"), "--local", "--nproc-per-node", "2", "--kernels", "local",
               "--teacher-port", "5571", "--rdzv-port", "29471",
               "--config", str(REPO / "configs" / "cpu_tiny.yaml"),
               f"student.checkpoint={assets / 'student'}", f"teacher.serve.model={assets / 'teacher'}",
               f"data.train_path={assets / 'train.jsonl'}", f"data.eval_path={assets / 'eval.jsonl'}",
               f"trainer.output_dir={out}", "trainer.num_steps=3", "logging.progress_bar=false"]
    log = tmp_path / "run_671b.log"
    with open(log, "w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                              timeout=900).returncode
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    # The teacher service the launcher started, not one the trainer started on its own.
    assert "TEACHER READY tcp://127.0.0.1:5571 (hf)" in text
    assert (out / "launch" / "teacher_address").read_text().strip() == "tcp://127.0.0.1:5571"
    config = (out / "config.yaml").read_text()
    assert "address: tcp://127.0.0.1:5571" in config and "teacher.secret" in config
    assert not (out / "teacher_service.log").exists()
    teacher_log = (out / "launch" / "teacher.log").read_text()
    assert f"--model={assets / 'teacher'}" in text and "teacher worker registered" in teacher_log
    assert json.loads((assets / "teacher" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in steps if "train/loss" in record] == [1, 2, 3]
    assert "megatron-gkd summary" in text and '"preempted": false' in text
    # Clean teardown: nothing that was started for this run is left.
    assert processes_mentioning(str(tmp_path)) == []
