"""Megatron-Core trains on the host under gloo, and the parallel layout does not change the numbers.

Every layout starts from the same full weights (the TP=1 reference's initial state, sharded per
layout) and sees the same micro-batches, so the loss after each optimizer step must equal the
single-process TP=1 run. That is what proves the CPU adaptor right, not merely that it runs.
"""

import math

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

NUM_STEPS = 3
RTOL = 1e-5


def _train(parallel_sizes: dict, spec_overrides: dict, full_state: dict | None, num_steps: int = NUM_STEPS):
    from megatron_gkd import parallel
    from megatron_gkd.testing import mcore

    state = parallel.initialize(**parallel_sizes)
    try:
        spec = mcore.TinyGPTSpec(**spec_overrides)
        chunks = mcore.build_model_chunks(spec, state)
        if full_state is not None:
            mcore.load_full_state_dict(chunks, full_state, state)
        initial = mcore.full_state_dict(chunks)
        optimizer = mcore.build_optimizer(spec, chunks)
        losses = [
            mcore.train_step(spec, chunks, optimizer, microbatches)
            for microbatches in mcore.synthetic_batches(spec, num_steps)
        ]
        final = mcore.full_state_dict(chunks)
        moved = sum(float((final[name] - initial[name]).abs().sum()) for name in initial)
        return {"losses": losses, "initial": initial if state.world_size == 1 else None, "moved": moved}
    finally:
        parallel.destroy()


def _last_stage_losses(results) -> list[float]:
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    assert losses, "no rank reported losses"
    for other in losses[1:]:
        assert other == losses[0], "last-stage ranks disagree on the loss"
    return losses[0]


@pytest.fixture(scope="module")
def dense_reference():
    [result] = run_distributed(_train, 1, args=({}, {}, None))
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert result["moved"] > 0, "the optimizer did not change the weights"
    return result


@pytest.mark.parametrize(
    "world_size, sizes",
    [
        (2, dict(tensor_model_parallel_size=2)),
        pytest.param(4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), marks=pytest.mark.slow),
        (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
        (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ],
    ids=["tp2", "tp2-pp2-1f1b", "pp2-vpp2", "tp2-sequence-parallel"],
)
def test_layout_matches_tp1(dense_reference, world_size, sizes):
    results = run_distributed(_train, world_size, args=(sizes, {}, dense_reference["initial"]))
    losses = _last_stage_losses(results)
    assert len(losses) == NUM_STEPS
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(dense_reference["losses"], dtype=torch.float64),
        rtol=RTOL,
        atol=0.0,
    )
    assert all(r["moved"] > 0 for r in results)


def test_distributed_optimizer_matches_tp1(dense_reference):
    # Two data-parallel ranks fed identical micro-batches average identical gradients, so the
    # sharded optimizer state must reproduce the single-rank run exactly.
    spec = dict(use_distributed_optimizer=True)
    results = run_distributed(_train, 2, args=({}, spec, dense_reference["initial"]))
    torch.testing.assert_close(
        torch.tensor(_last_stage_losses(results), dtype=torch.float64),
        torch.tensor(dense_reference["losses"], dtype=torch.float64),
        rtol=RTOL,
        atol=0.0,
    )


@pytest.mark.slow  # suite time; EP=2 trains in the default tier's tests/e2e/trainer/test_moe.py
def test_moe_expert_parallel_trains():
    spec = dict(num_moe_experts=4, moe_router_topk=2)
    [reference] = run_distributed(_train, 1, args=({}, spec, None))
    results = run_distributed(_train, 2, args=(dict(expert_model_parallel_size=2), spec, reference["initial"]))
    losses = _last_stage_losses(results)
    assert len(losses) == NUM_STEPS and all(math.isfinite(loss) for loss in losses)
    assert all(r["moved"] > 0 for r in results)
    # Both ranks see the same tokens, so the first loss (before any update) is the reference's.
    assert losses[0] == pytest.approx(reference["losses"][0], rel=RTOL)


def test_bf16_trains_with_fp32_main_params():
    results = run_distributed(_train, 2, args=(dict(tensor_model_parallel_size=2), dict(bf16=True), None))
    losses = _last_stage_losses(results)
    assert all(math.isfinite(loss) for loss in losses)
    assert all(r["moved"] > 0 for r in results)



def _adam_runs():
    """Each optimizer (plain, distributed) trained twice from the same weights: as built, and with the per-tensor loop
    Megatron leaves a torch AdamW with on the host. One process per rank for all four (spawns dominate the time)."""
    from megatron_gkd import parallel
    from megatron_gkd.testing import mcore

    state = parallel.initialize()
    results = {}
    try:
        for distributed_optimizer in (False, True):
            for fused in (True, False):
                spec = mcore.TinyGPTSpec(use_distributed_optimizer=distributed_optimizer)
                chunks = mcore.build_model_chunks(spec, state)
                optimizer = mcore.build_optimizer(spec, chunks)
                adams = [sub.optimizer for sub in getattr(optimizer, "chained_optimizers", [optimizer])]
                groups = [group for adam in adams for group in adam.param_groups]
                flags = [group["fused"] for group in groups]
                for group in groups:
                    group["fused"] = group["fused"] and fused
                initial = mcore.full_state_dict(chunks)
                for microbatches in mcore.synthetic_batches(spec, NUM_STEPS):
                    mcore.train_step(spec, chunks, optimizer, microbatches)
                final = mcore.full_state_dict(chunks)
                results[distributed_optimizer, fused] = {
                    "flags": flags, "final": final,
                    "moved": sum(float((final[n] - initial[n]).abs().sum()) for n in final)}
        return results
    finally:
        parallel.destroy()


def test_the_host_adam_is_torchs_fused_kernel_and_steps_as_the_loop_does():
    ranks = run_distributed(_adam_runs, 2)  # two data-parallel ranks: the distributed optimizer shards its state
    for distributed_optimizer in (False, True):
        built, looped = ranks[0][distributed_optimizer, True], ranks[0][distributed_optimizer, False]
        assert built["flags"] and all(flag is True for rank in ranks for flag in rank[distributed_optimizer, True]["flags"])
        assert built["moved"] > 0
        for name, tensor in looped["final"].items():
            torch.testing.assert_close(built["final"][name], tensor, rtol=0, atol=1e-6, msg=name)
