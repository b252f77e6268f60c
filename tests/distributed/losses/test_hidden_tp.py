"""The hidden-signal loss at TP=2 (gloo ranks) against the dense float64 reference: every divergence,
fused and unfused, chunked and not, padded and unequal tables, a shard of padding only, the top-k
path at k = V, and the teacher's exact top-k (hidden_topk). One spawn runs everything; the parent asserts on the collected errors."""

import pytest

from megatron_gkd.testing import hidden_losses as cases
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def test_hidden_losses_at_tp2_match_the_reference():
    per_rank = run_distributed(cases.check_everything, 2)
    for rank, result in enumerate(per_rank):
        assert len(result["cases"]) == len(cases.make_cases(2)) * len(cases.LOSS_CONFIGS) * 4
        assert len(result["topk"]) >= 3 * len(cases.LOSS_CONFIGS)
        assert len(result["token_logprobs"]) == len(cases.make_cases(2)) * len(cases.TOKEN_LOGPROB_TOLERANCES)
        assert "hidden_topk" in result  # the cross-tokenizer teacher's exact top-k, checked by failures()
        assert cases.failures(result) == [], f"rank {rank}"

