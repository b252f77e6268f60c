"""The command under torchrun at TP=2 x PP=2 writes the student a one-process run writes (same kept indices)."""

import json
import os
import subprocess
import sys

import pytest

from megatron_gkd.testing.distributed import free_port
from megatron_gkd.testing.hf_models import make_tiny_checkpoint, read_safetensors_dir
from tests.unit.data.prompt_files import TEMPLATE, save_tokenizer, write_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TARGETS = ["--num-layers", "0.5", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "2"]


def _prune(launcher: list[str], teacher, prompts, out, layout: list[str]) -> dict:
    command = [*launcher, "-m", "megatron_gkd.prune", "--teacher", str(teacher), "--out", str(out),
               "--calibration", prompts, "--num-samples", "4", "--seq-length", "16", *TARGETS, *layout]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1].removeprefix("megatron-gkd prune: "))


def test_torchrun_tp2_pp2_writes_what_one_process_writes(tmp_path):
    import torch

    teacher = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "teacher", vocab_size=64, seed=5)
    save_tokenizer(teacher, TEMPLATE)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"w{i} w{i + 7}", "response": f"w{i + 1} w{i + 3}"}
                                                        for i in range(40)])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port())]
    sharded = _prune(torchrun, teacher, prompts, tmp_path / "tp2pp2",
                     ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    single = _prune([sys.executable], teacher, prompts, tmp_path / "single", [])
    assert sharded["kept_layers"] == single["kept_layers"] and len(single["kept_layers"]) == 2
    assert sharded["calibration_loss"] == pytest.approx(single["calibration_loss"], rel=1e-5)
    kept = [json.loads((tmp_path / name / "pruning.json").read_text())["kept"] for name in ("tp2pp2", "single")]
    assert kept[0] == kept[1]
    tensors = [read_safetensors_dir(tmp_path / name) for name in ("tp2pp2", "single")]
    assert tensors[0].keys() == tensors[1].keys()
    for name, value in tensors[1].items():
        assert torch.equal(tensors[0][name], value), name
