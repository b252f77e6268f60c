"""The megatron reference engine (TP=1 and TP=2) against float64 transformers on a tiny Llama.

Both layouts run in one 2-rank spawn (TP=1 as two data-parallel replicas, then TP=2); every rank must
return the same batch, greedy responses equal transformers' and log-probs agree within 1e-4.
"""

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.rollout import EOS_TOKEN_ID, HFReference, assert_rollout_matches, make_rollout_checkpoint

pytestmark = pytest.mark.distributed

PROMPTS = [[1, 17, 99, 3, 250], [1, 42], [1, 7, 7, 7, 8, 9, 10, 11, 12, 13, 14, 200, 31]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8, logprobs_k=4)
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.9, top_k=50, max_tokens=6, n=2, seed=7)


def _sample(model_dir):
    """Rank body: greedy and sampled batches at TP=1, then at TP=2."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.rollout import build_engine

    batches = {}
    for tp in (1, 2):
        parallel.initialize(tensor_model_parallel_size=tp)
        engine = build_engine("megatron", chunks=load_hf(model_dir, dtype=torch.float32), max_model_len=64,
                              eos_token_id=EOS_TOKEN_ID, vocab_size=256)
        batches[tp] = (engine.generate(PROMPTS, GREEDY), engine.generate(PROMPTS[:2], SAMPLED))
        parallel.destroy()
    return batches


def test_megatron_engine_matches_transformers_tp1_tp2(tmp_path):
    model_dir = make_rollout_checkpoint(tmp_path / "llama")
    reference = HFReference(model_dir)
    results = run_distributed(_sample, 2, args=(model_dir,))
    for tp in (1, 2):
        greedy, sampled = results[0][tp]
        for other in results[1:]:  # every rank drew the same tokens
            assert torch.equal(other[tp][0].response_ids, greedy.response_ids)
            assert torch.equal(other[tp][1].response_ids, sampled.response_ids)
        for i, prompt in enumerate(PROMPTS):
            assert greedy.response(i) == reference.greedy(prompt, GREEDY.max_tokens), f"tp={tp} prompt {i}"
        assert_rollout_matches(greedy, reference)
        assert greedy.topk_ids.shape[2] == 4
        assert sampled.group_ids.tolist() == [0, 0, 1, 1]
        assert_rollout_matches(sampled, reference)
    # Sampling is seeded per sample, so the TP split does not change what is drawn.
    assert torch.equal(results[0][1][1].response_ids, results[0][2][1].response_ids)
