"""The vllm engine's two multi-process layouts against float64 transformers (slow: vLLM starts per rank).

Colocated: 2 ranks each hold a TP=2 vLLM shard (``external_launcher``) after the harness has
initialised a gloo default group, as a trainer does. Disaggregated: ranks 0-1 are trainers, rank 2
serves vLLM (its engine core in a spawned child) and the trainers receive the same RolloutBatch.
"""

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.rollout import HFReference, assert_rollout_matches, make_rollout_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [[1, 17, 99, 3, 250], [1, 42]]
SAMPLING = SamplingConfig(temperature=0.0, max_tokens=8, logprobs_k=3)
ENGINE = dict(max_model_len=64, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)


def _colocated(model_dir, tensor_parallel_size):
    from megatron_gkd.rollout import build_engine

    engine = build_engine("vllm", model=model_dir, tensor_parallel_size=tensor_parallel_size,
                          **ENGINE)
    try:
        return engine.generate(PROMPTS, SAMPLING)
    finally:
        engine.close()


def _disaggregated(model_dir):
    import multiprocessing

    from megatron_gkd.rollout.remote import build_disaggregated, new_rollout_group

    # The harness spawns daemonic ranks, which may not start children; the serving rank's vLLM runs
    # its engine core in a child process (torchrun's workers are not daemons).
    multiprocessing.current_process().daemon = False
    side = build_disaggregated(engine="vllm", model=model_dir, group=new_rollout_group([0, 1, 2]),
                        server_rank=2, trainer_rank=0, **ENGINE)
    if torch.distributed.get_rank() == 2:
        try:
            return side.serve()
        finally:
            side.close()
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            side.generate([[1] * 64], SAMPLING)
        return side.generate(PROMPTS, SAMPLING)
    finally:
        side.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_rollout_checkpoint(tmp_path_factory.mktemp("rollout_llama"))


def _check(batch, reference):
    for i, prompt in enumerate(PROMPTS):
        assert batch.response(i) == reference.greedy(prompt, SAMPLING.max_tokens)
    assert_rollout_matches(batch, reference)


@pytest.mark.parametrize("tensor_parallel_size", [2, 1], ids=["tp2", "tp1-dp2"])
def test_colocated_on_two_ranks(model_dir, tensor_parallel_size):
    """TP=2: one engine sharded over both ranks; TP=1: two vLLM data-parallel replicas."""
    reference = HFReference(model_dir)
    batches = run_distributed(_colocated, 2, args=(model_dir, tensor_parallel_size), timeout=600)
    for batch in batches:
        _check(batch, reference)


def test_disaggregated_server_rank(model_dir):
    reference = HFReference(model_dir)
    results = run_distributed(_disaggregated, 3, args=(model_dir,), timeout=600)
    assert results[2] == 2  # the rejected request and the good one
    for batch in results[:2]:
        _check(batch, reference)
