"""Resuming from an older step abandons the newer checkpoints (issue 14, item 10).

One rank, the tiny GPT, model only, no training between saves (only the directories matter): a run saves 50 and
100; a resumed run loads 50 explicitly, then saves 60, 70 and 80 with ``keep_last_n=2``. The newer
checkpoint of the abandoned branch must be moved aside (not pruned into place, not chosen later, even
with ``latest`` gone), and ``latest`` must name the resumed step right after the load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gkd import parallel
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.mcore import TinyGPTSpec, build_model_chunks
from megatron_gkd.trainer import checkpoint_dirs
from megatron_gkd.trainer.checkpointing import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

SPEC = TinyGPTSpec(num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=64)


def _save(root, step, chunks, state, keep_last_n=None):
    save_checkpoint(root, step, model_chunks=chunks, optimizer=None, scheduler=None,
                    data_state={"step": step}, parallel_state=state, keep_last_n=keep_last_n)


def _branches(root: str) -> dict:
    state = parallel.initialize()
    chunks = build_model_chunks(SPEC, state)
    for step in (50, 100):
        _save(root, step, chunks, state)
    resumed = load_checkpoint(root, model_chunks=chunks, optimizer=None, scheduler=None,
                              parallel_state=state, step=50)
    latest_after_load = checkpoint_dirs.read_latest(Path(root))
    for step in (60, 70, 80):
        _save(root, step, chunks, state, keep_last_n=2)
    parallel.destroy()
    return {"resumed": resumed, "latest_after_load": latest_after_load}


def test_resuming_from_an_older_step_retires_the_newer_branch(tmp_path):
    root = tmp_path / "run"
    (result,) = run_distributed(_branches, 1, args=(str(root),))
    assert result["resumed"] == (50, {"step": 50})
    assert result["latest_after_load"] == "iter_0000050"
    names = sorted(entry.name for entry in root.iterdir())
    assert names == [checkpoint_dirs.ABANDONED, "iter_0000070", "iter_0000080", "latest"], names
    (retired,) = (root / checkpoint_dirs.ABANDONED).iterdir()
    assert retired.name.startswith("iter_0000100")
    (root / checkpoint_dirs.LATEST).unlink()
    assert checkpoint_dirs.find_checkpoint(root).step == 80
