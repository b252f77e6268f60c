"""Saving under torchrun from an entry script *without* an ``if __name__ == "__main__":`` guard.

Megatron's default writer starts a spawn ``multiprocessing.Manager`` that re-imports the entry
script, so such a script hung after ``common.pt`` (megatron-core 0.16.1). The in-process writer of
:mod:`megatron_gkd.trainer.checkpointing` starts no process, so the save completes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_gkd.testing.distributed import free_port
from megatron_gkd.trainer import checkpoint_dirs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

UNGUARDED_SCRIPT = textwrap.dedent(
    """
    import sys
    from megatron_gkd import platform
    platform.setup("cpu")
    from megatron_gkd import parallel
    from megatron_gkd.testing.mcore import (
        SyntheticData, TinyGPTSpec, build_model_chunks, build_optimizer, build_scheduler, train_step,
    )
    from megatron_gkd.trainer.checkpointing import save_checkpoint

    spec = TinyGPTSpec(num_layers=2, num_microbatches=2)
    state = parallel.initialize(tensor_model_parallel_size=2)
    chunks = build_model_chunks(spec, state)
    optimizer = build_optimizer(spec, chunks)
    scheduler = build_scheduler(spec, optimizer)
    data = SyntheticData(spec)
    train_step(spec, chunks, optimizer, next(data), scheduler=scheduler)
    save_checkpoint(sys.argv[1], 1, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                    data_state=data.state_dict(), parallel_state=state)
    parallel.destroy()
    """
)


def test_unguarded_torchrun_script_saves(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    root = tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), str(script), str(root),
    ]  # fmt: skip
    completed = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert checkpoint_dirs.read_latest(root) == "iter_0000001"
    assert checkpoint_dirs.incomplete_reason(Path(root) / "iter_0000001") is None
