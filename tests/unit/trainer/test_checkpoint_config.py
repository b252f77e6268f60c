"""checkpoint.content_hashes reaches the checkpoint writer (the README and SECURITY.md describe it as a config key)."""

import pathlib
import types

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.trainer import checkpointing
from megatron_gkd.trainer.loop import Trainer
from megatron_gkd.trainer.metrics import Timers

DEMO = pathlib.Path(__file__).resolve().parents[3] / "configs" / "demo_cpu.yaml"


@pytest.mark.parametrize("content_hashes", [False, True])
def test_trainer_saves_with_the_configured_content_hashes(tmp_path, monkeypatch, content_hashes):
    saved = {}
    monkeypatch.setattr(checkpointing, "save_checkpoint", lambda root, step, **kwargs: saved.update(kwargs, step=step))
    trainer = Trainer.__new__(Trainer)  # only what _save_checkpoint reads, no process groups
    trainer.config = load_config(DEMO, [f"checkpoint.content_hashes={str(content_hashes).lower()}"])
    trainer.out, trainer.timers, trainer.step, trainer.tokens_trained, trainer.state = tmp_path, Timers(), 3, 0, None
    trainer.student = types.SimpleNamespace(chunks=[], optimizer=None, lr_scheduler=None)
    trainer.sampler = types.SimpleNamespace(state_dict=lambda: {"epoch": 0, "position": 0})
    trainer._save_checkpoint()
    assert saved["step"] == 3 and saved["content_hashes"] is content_hashes
