"""The README's two commands: exactly two, the test command is what CI runs, the run command works."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README must open with a bash block holding its two commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def _environment(tmp_path: pathlib.Path, venv: str) -> dict:
    env = dict(os.environ, VENV=venv, MEGATRON_GKD_OUTPUT_DIR=str(tmp_path / "out"),
               MEGATRON_GKD_ASSETS=str(tmp_path / "assets"))
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    run_command, test_command = readme_commands()
    assert run_command == "bash scripts/run_demo.sh"
    assert test_command == "bash scripts/run_tests.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci


def _check_demo(result: subprocess.CompletedProcess, out_dir: pathlib.Path) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.split("megatron-gkd summary: ", 1)[1])
    assert summary["steps"] == 6 and summary["metrics"] == str((out_dir / "metrics.jsonl").resolve())
    assert "eval/kl_to_teacher_before" in summary and "eval/kl_to_teacher_after" in summary
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "train/loss" in r] == list(range(1, 7))
    assert (out_dir / "checkpoints" / "latest").exists() and (out_dir / "hf" / "step_6" / "config.json").exists()


def test_run_command_trains_and_says_where_outputs_are(tmp_path):
    run_command = readme_commands()[0]
    result = subprocess.run(
        run_command, shell=True, cwd=ROOT, env=_environment(tmp_path, sys.prefix),
        capture_output=True, text=True, timeout=600,
    )
    _check_demo(result, tmp_path / "out")


@pytest.mark.slow
def test_both_commands_in_a_fresh_clone_with_a_fresh_virtualenv(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = _environment(tmp_path, str(clone / ".venv"))
    run_command, test_command = readme_commands()
    demo = subprocess.run(run_command, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=3000)
    _check_demo(demo, tmp_path / "out")
    # The whole suite inside a test would recurse into this test; the unit tier proves the command.
    tests = subprocess.run(
        f"{test_command} tests/unit -q", shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=3000
    )
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert re.search(r"\d+ passed", tests.stdout)
