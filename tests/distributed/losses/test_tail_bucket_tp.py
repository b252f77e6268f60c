"""The tail bucket at TP=2 (gloo ranks): every divergence over the teacher's ids and the mass outside them, unfused on
the logit shards and fused on the output weight's rows, against the dense float64 reference, with padding rows in the
last shard and a last shard of padding only (megatron_gkd/testing/tail_bucket.py; TP=1: tests/unit/losses)."""

import pytest

from megatron_gkd.testing import tail_bucket as cases
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def test_tail_bucket_matches_the_reference_at_tp2():
    per_rank = run_distributed(cases.tail_errors_distributed, 2)
    for rank, errors in enumerate(per_rank):
        assert len(errors) == len(cases.real_vocab_sizes(2)) * len(cases.TAIL_LOSSES) * 2 * 2
        assert cases.failures(errors) == [], f"rank {rank}"
