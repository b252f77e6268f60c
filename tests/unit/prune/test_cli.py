"""``python -m megatron_gkd.prune``: bad arguments exit 2 with the fix, a run writes a student transformers loads."""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_gkd.prune.__main__ import main
from megatron_gkd.testing.pruning import make_gqa_checkpoint
from tests.unit.data.prompt_files import TEMPLATE, VOCAB, save_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The tiny 9 / 3-head teacher with a word-level tokenizer and chat template of its vocabulary."""
    path = tmp_path_factory.mktemp("teacher")
    make_gqa_checkpoint(path, seed=4)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] >= len(VOCAB)
    save_tokenizer(path, TEMPLATE)
    return path


@pytest.mark.parametrize("arguments, message", [
    (["--num-attention-heads", "5"], r"choose one of \[3, 6, 9\]"),
    (["--num-layers", "9"], "exceeds the teacher's 4"),
    (["--calibration", "missing.jsonl"], "is not a file"),
])
def test_bad_arguments_exit_2_with_the_fix(arguments, message, teacher, tmp_path, capsys):
    assert main(["--teacher", str(teacher), "--out", str(tmp_path / "student"), *arguments]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("prune error: ")
    assert re.search(message, error[0]), error[0]


def test_an_existing_output_is_refused_before_any_work(teacher, tmp_path, capsys):
    assert main(["--teacher", str(teacher), "--out", str(tmp_path), "--num-layers", "2"]) == 2
    assert "exists; remove it" in capsys.readouterr().err


def test_a_run_writes_a_student_with_the_report_and_the_chat_template(teacher, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"w{i} w{i + 1} w{i + 2}", "response": f"w{i + 3}"}
                                                        for i in range(40)])
    out = tmp_path / "student"
    command = [sys.executable, "-m", "megatron_gkd.prune", "--teacher", str(teacher), "--out", str(out),
               "--num-layers", "2", "--ffn-hidden-size", "0.5", "--num-query-groups", "2", "--calibration", prompts,
               "--num-samples", "4", "--seq-length", "16", "--depth-metric", "loss"]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = json.loads(finished.stdout.strip().splitlines()[-1].removeprefix("megatron-gkd prune: "))
    assert summary["student"]["num_layers"] == 2 and summary["depth_metric"] == "loss"
    assert summary["student"]["num_query_groups"] == 2 and summary["student"]["num_attention_heads"] == 6
    assert summary["student_parameters"] < summary["teacher_parameters"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(model.model.layers) == 2 and model.config.intermediate_size == 48
    assert AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE
    assert json.loads((out / "pruning.json").read_text())["kept"]["layers"] == summary["kept_layers"]
