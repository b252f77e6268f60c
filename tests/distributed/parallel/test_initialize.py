"""parallel.initialize over real gloo groups: coordinates, shard gather/scatter, actionable errors."""

import pytest
import torch
import torch.distributed as dist

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _layout_and_shards():
    from megatron_gkd import parallel

    state = parallel.initialize(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
        gathered = {}
        for dim in (0, 1):
            for num_parts in (1, 2):
                shard = parallel.scatter_tp(full, dim, state.tp_group, num_parts=num_parts)
                gathered[(dim, num_parts)] = torch.equal(
                    parallel.gather_tp(shard, dim, state.tp_group, num_parts=num_parts), full
                )
        control = state.control_group
        ranks = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(ranks, group=control)
        return dict(
            control=(dist.get_world_size(control), dist.get_backend(control), float(ranks)),
            tp_rank=state.tp_rank,
            pp_rank=state.pp_rank,
            dp_size=state.data_parallel_size,
            tp_peers=dist.get_world_size(state.tp_group),
            last=state.is_pipeline_last_stage,
            gathered=gathered,
        )
    finally:
        parallel.destroy()


def _mismatched_world():
    from megatron_gkd import parallel

    try:
        parallel.initialize(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    except ValueError as error:
        return str(error)
    return None


def test_tp2_pp2_coordinates_and_shard_round_trip():
    results = run_distributed(_layout_and_shards, 4)
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        assert result["dp_size"] == 1 and result["tp_peers"] == 2
        assert result["control"] == (4, "gloo", 0.0 + 1 + 2 + 3)  # every rank, on host memory
        assert result["last"] == (result["pp_rank"] == 1)
        assert all(result["gathered"].values()), result["gathered"]


def test_world_size_that_does_not_fit_is_explained():
    messages = run_distributed(_mismatched_world, 2)
    for message in messages:
        assert message is not None and "launch a multiple of 4 processes" in message
