"""Distributed checkpoints: resume under another layout, and never from a half-written save.

The workload is the tiny Megatron GPT of :mod:`megatron_gkd.testing.mcore` (Adam, a warm-up + cosine
LR schedule, a resumable synthetic data stream). The reference run trains 2 steps at TP=2, saves,
then trains steps 3 to 5. Resumed runs in fresh processes must reproduce the three losses: step 3's
loss checks the model weights and the data position; step 4's the Adam moments and step count (and
the LR of step 3, which comes back with the optimizer's param groups); step 5's the LR the scheduler
sets for step 4.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal

import pytest
import torch

from megatron_gkd import parallel
from megatron_gkd.testing.distributed import DistributedFailure, run_distributed
from megatron_gkd.testing.mcore import (
    SyntheticData,
    TinyGPTSpec,
    build_model_chunks,
    build_optimizer,
    build_scheduler,
    train_step,
)
from megatron_gkd.trainer import checkpoint_dirs
from megatron_gkd.trainer.checkpointing import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

SPEC = TinyGPTSpec(num_layers=4, num_microbatches=2)
SAVE_STEP = 2
NUM_AFTER = 3
LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp1": (1, dict()),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp2vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _capture_logs() -> _Records:
    handler = _Records()
    for name in ("megatron_gkd.trainer.checkpointing", "megatron_gkd.trainer.checkpoint_dirs"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    return handler


def _rng_probe() -> list[float]:
    """Draws from the host generator and Megatron's tensor-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    host = torch.rand(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(3)
    return torch.cat([host, tracker]).tolist()


def _build(state, seed: int):
    chunks = build_model_chunks(dataclasses.replace(SPEC, seed=seed), state)
    optimizer = build_optimizer(SPEC, chunks)
    return chunks, optimizer, build_scheduler(SPEC, optimizer)


def _train_save_continue(root: str, num_after: int) -> dict:
    state = parallel.initialize(tensor_model_parallel_size=2)
    chunks, optimizer, scheduler = _build(state, SPEC.seed)
    data = SyntheticData(SPEC)
    for _ in range(SAVE_STEP):
        train_step(SPEC, chunks, optimizer, next(data), scheduler=scheduler)
    try:  # a per-rank data position cannot be common state: refused before anything is written
        save_checkpoint(
            root,
            SAVE_STEP,
            model_chunks=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            data_state={"position": state.rank},
            parallel_state=state,
        )
        refused = None
    except ValueError as error:
        refused = str(error)
    save_checkpoint(
        root,
        SAVE_STEP,
        model_chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        data_state=data.state_dict(),
        parallel_state=state,
    )
    rng = _rng_probe()
    losses = [train_step(SPEC, chunks, optimizer, next(data), scheduler=scheduler) for _ in range(num_after)]
    parallel.destroy()
    return {"losses": losses, "rng": rng, "refused": refused}


def _resume(root: str, sizes: dict, num_after: int, kill_during_save: bool = False) -> dict:
    logs = _capture_logs()
    state = parallel.initialize(**sizes)
    # Another seed: nothing of the resumed model may come from its own initialisation.
    chunks, optimizer, scheduler = _build(state, SPEC.seed + 99)
    step, data_state = load_checkpoint(
        root, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, parallel_state=state
    )
    data = SyntheticData(SPEC, seed=0)
    data.load_state_dict(data_state)
    rng = _rng_probe()
    losses = [train_step(SPEC, chunks, optimizer, next(data), scheduler=scheduler) for _ in range(num_after)]
    if kill_during_save:
        _save_and_die_on_rank1(root, step + num_after, chunks, optimizer, scheduler, data, state)
    parallel.destroy()
    return {
        "step": step,
        "scheduler_steps": scheduler.num_steps - num_after,
        "losses": losses,
        "rng": rng,
        "logs": logs.messages,
    }


def _save_and_die_on_rank1(root, step, chunks, optimizer, scheduler, data, state) -> None:
    """Rank 1 is SIGKILLed once it has written (and is fsyncing) its first shard file of the save."""
    if state.rank == 1:
        real_fsync = os.fsync

        def fsync_then_die(fd):
            real_fsync(fd)
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
                os.kill(os.getpid(), signal.SIGKILL)

        os.fsync = fsync_then_die
    save_checkpoint(
        root,
        step,
        model_chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        data_state=data.state_dict(),
        parallel_state=state,
    )
    raise AssertionError("the save should not have completed: rank 1 was to be killed during it")


def _last_stage_losses(results: list[dict]) -> list[float]:
    losses = [result["losses"] for result in results if result["losses"][0] is not None]
    assert losses, "no rank returned losses"
    return losses[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt") / "run"
    results = run_distributed(_train_save_continue, 2, args=(str(root), NUM_AFTER))
    return {
        "root": root,
        "losses": _last_stage_losses(results),
        "rng": [r["rng"] for r in results],
        "refused": [r["refused"] for r in results],
    }


def test_save_writes_a_complete_checkpoint_and_latest(reference):
    for message in reference["refused"]:
        assert message is not None and "data_state differs between rank 0" in message
    root = reference["root"]
    assert sorted(entry.name for entry in root.iterdir()) == ["iter_0000002", "latest"]
    assert checkpoint_dirs.read_latest(root) == "iter_0000002"
    assert checkpoint_dirs.incomplete_reason(root / "iter_0000002") is None
    assert not [entry.name for entry in root.iterdir() if entry.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "layout", ["tp1", "pp2", "tp2", pytest.param("pp2vpp2", marks=pytest.mark.slow)]
)
def test_resume_matches_uninterrupted_run(reference, layout):
    world_size, sizes = LAYOUTS[layout]
    results = run_distributed(_resume, world_size, args=(str(reference["root"]), sizes, NUM_AFTER))
    assert all(result["step"] == SAVE_STEP == result["scheduler_steps"] for result in results)
    torch.testing.assert_close(
        torch.tensor(_last_stage_losses(results), dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        rtol=1e-6,
        atol=0.0,
    )
    rng_warnings = [m for m in results[0]["logs"] if "RNG states of iter_0000002 are not restored" in m]
    if layout == "tp2":
        # Same layout: every rank draws what it would have drawn right after the save.
        assert [result["rng"] for result in results] == reference["rng"]
        assert not rng_warnings
    else:
        assert rng_warnings, results[0]["logs"]


def test_half_written_checkpoint_is_skipped(reference, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(reference["root"], root)
    # Resume at TP=2, train step 3, save it: rank 1 dies in the middle of writing its shards (rank 0
    # then either fails on the broken connection or is killed by the harness).
    with pytest.raises(DistributedFailure, match=r"ranks \[1\] died|failed on rank 0:[\s\S]*Connection"):
        run_distributed(_resume, 2, args=(str(root), LAYOUTS["tp2"][1], 1), kwargs={"kill_during_save": True})
    leftovers = [entry for entry in root.iterdir() if entry.name.startswith(".tmp-iter_0000003-")]
    assert len(leftovers) == 1 and any(leftovers[0].glob("*.distcp"))
    assert not (root / "iter_0000003").exists()
    # The pointer still names the previous complete checkpoint.
    assert checkpoint_dirs.read_latest(root) == "iter_0000002"

    # A second failure mode: a directory that reached its final name without a valid marker (a
    # non-atomic copy, a truncated sync), with `latest` pointing at it.
    torn = root / "iter_0000004"
    shutil.copytree(leftovers[0], torn)
    shard = sorted(torn.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    checkpoint_dirs.write_latest(root, torn.name)

    results = run_distributed(_resume, 1, args=(str(root), LAYOUTS["tp1"][1], 1))
    assert results[0]["step"] == SAVE_STEP
    logs = results[0]["logs"]
    assert any("names 'iter_0000004', which is incomplete (no completion marker)" in m for m in logs), logs
    assert "iter_0000004 is incomplete (no completion marker); resuming from iter_0000002" in logs
    assert (
        f"{leftovers[0].name} is incomplete (a save that never finished); resuming from iter_0000002" in logs
    )
    assert results[0]["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6, abs=0.0)
