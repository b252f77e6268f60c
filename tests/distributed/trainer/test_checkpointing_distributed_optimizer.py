"""Distributed-optimizer checkpoints resume into a *fresh* optimizer (no Apex, no Transformer Engine).

The reference run trains 2 steps with Megatron's DistributedOptimizer (optimizer state sharded over
2 data-parallel ranks), saves, then trains 2 more. A resumed run in fresh processes builds a new model
from another seed and a new distributed optimizer that has taken no step, loads the checkpoint and
must reproduce both losses: the first checks the weights, the second the Adam moments and step count.
The layouts resumed into change the data-parallel split (DP=2 -> DP=1) or keep it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gkd import parallel
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.mcore import SyntheticData, TinyGPTSpec, build_model_chunks, build_optimizer, build_scheduler, train_step
from megatron_gkd.trainer.checkpointing import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

SPEC = TinyGPTSpec(num_layers=2, num_microbatches=2, use_distributed_optimizer=True)
SAVE_STEP = 2
NUM_AFTER = 2


def _build(state, seed: int):
    chunks = build_model_chunks(dataclasses.replace(SPEC, seed=seed), state)
    optimizer = build_optimizer(SPEC, chunks)
    return chunks, optimizer, build_scheduler(SPEC, optimizer)


def _train_save_continue(root: str) -> list[float]:
    state = parallel.initialize()
    chunks, optimizer, scheduler = _build(state, SPEC.seed)
    data = SyntheticData(SPEC)
    for _ in range(SAVE_STEP):
        train_step(SPEC, chunks, optimizer, next(data), scheduler=scheduler)
    save_checkpoint(root, SAVE_STEP, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                    data_state=data.state_dict(), parallel_state=state)
    losses = [train_step(SPEC, chunks, optimizer, next(data), scheduler=scheduler) for _ in range(NUM_AFTER)]
    parallel.destroy()
    return losses


def _resume(root: str) -> dict:
    state = parallel.initialize()
    chunks, optimizer, scheduler = _build(state, SPEC.seed + 99)
    step, data_state = load_checkpoint(root, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                                       parallel_state=state)
    data = SyntheticData(SPEC, seed=0)
    data.load_state_dict(data_state)
    losses = [train_step(SPEC, chunks, optimizer, next(data), scheduler=scheduler) for _ in range(NUM_AFTER)]
    parallel.destroy()
    return {"step": step, "losses": losses}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distopt") / "run"
    losses = run_distributed(_train_save_continue, 2, args=(str(root),))
    assert losses[0] == losses[1]
    return {"root": root, "losses": losses[0]}


@pytest.mark.parametrize("world_size", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["dp2", "dp1"])  # suite time
def test_distributed_optimizer_resumes_into_a_fresh_optimizer(reference, world_size):
    results = run_distributed(_resume, world_size, args=(str(reference["root"]),))
    for result in results:
        assert result["step"] == SAVE_STEP
        torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                                   torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-6, atol=0.0)
