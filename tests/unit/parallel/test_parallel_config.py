"""Parallel sizes are validated with actionable messages; shard helpers invert each other."""

import pytest
import torch

from megatron_gkd.parallel import ParallelConfig, merge_shards, shard_for_rank


def test_data_parallel_size_is_what_remains():
    config = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert config.data_parallel_size(8) == 2


@pytest.mark.parametrize(
    "kwargs, world_size, message",
    [
        (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6, "not divisible by tensor_model"),
        (dict(expert_model_parallel_size=4), 2, "expert_model_parallel_size"),
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), 2, "expert_tensor_parallel_size"),
    ],
)
def test_sizes_that_do_not_fit_the_world(kwargs, world_size, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs).data_parallel_size(world_size)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size must be a positive integer"),
        (dict(pipeline_model_parallel_size=1.5), "pipeline_model_parallel_size must be a positive integer"),
        (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
        (dict(sequence_parallel=True), "sequence_parallel needs tensor_model_parallel_size > 1"),
        (dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be"),
    ],
)
def test_invalid_sizes_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_expert_tensor_parallel_defaults_to_tensor_parallel():
    assert ParallelConfig(tensor_model_parallel_size=2).resolved_expert_tensor_parallel_size == 2
    assert ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=1).resolved_expert_tensor_parallel_size == 1


def test_interleaved_two_stage_pipeline_disables_batched_p2p():
    two = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    four = ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    plain = ParallelConfig(pipeline_model_parallel_size=2)
    assert two.transformer_config_kwargs()["batch_p2p_comm"] is False
    assert four.transformer_config_kwargs()["batch_p2p_comm"] is True
    assert plain.transformer_config_kwargs()["batch_p2p_comm"] is True
    assert plain.transformer_config_kwargs()["virtual_pipeline_model_parallel_size"] is None


@pytest.mark.parametrize("num_parts", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
def test_shards_round_trip(dim, num_parts):
    full = torch.arange(8 * 12, dtype=torch.float64).reshape(8, 12)
    shards = [shard_for_rank(full, dim, rank, 2, num_parts=num_parts) for rank in range(2)]
    assert torch.equal(merge_shards(shards, dim, num_parts=num_parts), full)


def test_gated_shards_hold_their_slice_of_each_part():
    gate, up = torch.zeros(4, 3), torch.ones(4, 3)
    shard = shard_for_rank(torch.cat([gate, up]), 0, 1, 2, num_parts=2)
    assert torch.equal(shard, torch.cat([gate[2:], up[2:]]))


def test_uneven_split_is_an_error():
    with pytest.raises(ValueError, match="does not split"):
        shard_for_rank(torch.zeros(6, 2), 0, 0, 4)
