"""checkpoint.content_hashes reaches the checkpoint writer (the README and SECURITY.md describe it as a config key)."""

import pathlib
import types

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.trainer import checkpointing
from megatron_gkd.trainer.metrics import Timers

DEMO = pathlib.Path(__file__).resolve().parents[3] / "configs" / "demo_cpu.yaml"


@pytest.mark.parametrize("content_hashes", [False, True])
def test_trainer_saves_with_the_configured_content_hashes(tmp_path, monkeypatch, content_hashes):
    saved = {}
    monkeypatch.setattr(checkpointing, "save_checkpoint", lambda root, step, **kwargs: saved.update(kwargs, step=step))
    config = load_config(DEMO, [f"checkpoint.content_hashes={str(content_hashes).lower()}"])
    student = types.SimpleNamespace(chunks=[], optimizer=None, lr_scheduler=None)
    checkpoints = checkpointing.RunCheckpoints(config, tmp_path, student, None, Timers())  # no process groups
    checkpoints.save(3, {"epoch": 0, "position": 0}, tokens_trained=0)
    assert saved["step"] == 3 and saved["content_hashes"] is content_hashes
    assert saved["data_state"]["sampler"] == {"epoch": 0, "position": 0}
