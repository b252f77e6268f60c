"""The conversion CLI under torchrun: HF -> Megatron dist checkpoint (TP=2) -> HF (EP=2), bit for bit.

The second conversion reads the checkpoint with another layout, so ``dist_checkpointing`` reshards
(tensor-parallel shards become whole tensors, experts split across ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_gkd import platform
from megatron_gkd.testing.distributed import free_port
from megatron_gkd.testing.hf_models import make_tiny_checkpoint, read_safetensors_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _torchrun(num_processes: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={num_processes}",
        f"--master_port={free_port()}", "-m", "megatron_gkd.models.convert", *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{platform.PLATFORM_ENV: "cpu"})
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 or not check, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_hf_to_mcore_to_hf_under_torchrun_reproduces_every_tensor(tmp_path):
    source = make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "hf")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    _torchrun(2, "hf-to-mcore", "--hf", source, "--out", str(mcore), "--tensor-model-parallel-size", "2")
    assert (mcore / "metadata.json").is_file() and (mcore / "hf" / "config.json").is_file()
    _torchrun(2, "mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--expert-model-parallel-size", "2")
    original, converted = read_safetensors_dir(source), read_safetensors_dir(back)
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype and torch.equal(converted[name], tensor), name
    # Written whole: nothing is left beside the outputs, and an existing output is refused, not overwritten.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "mcore"]
    again = _torchrun(1, "mcore-to-hf", "--mcore", str(mcore), "--out", str(back), check=False)
    assert again.returncode != 0 and f"--out {back} exists" in again.stderr
    assert read_safetensors_dir(back).keys() == original.keys()
