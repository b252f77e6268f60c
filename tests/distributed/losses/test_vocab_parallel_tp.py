"""Vocab-parallel losses at TP=2 and TP=4 (gloo ranks) against the dense float64 reference.

One spawn per TP size runs every case x loss config x dtype, the fused-vs-unfused comparison and the
vocab-parallel top-k inside the ranks (spawning is the slow part); the parent asserts on the collected
errors, so a failure names the case, loss and dtype.
"""

import pytest

from megatron_gkd.testing import losses as cases
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("tp_size", [2, 4])
def test_losses_fused_path_and_topk_match_references(tp_size):
    per_rank = run_distributed(cases.check_everything, tp_size)
    expected_count = len(cases.make_cases(tp_size)) * len(cases.LOSS_CONFIGS) * 3
    for rank, result in enumerate(per_rank):
        assert len(result["cases"]) == expected_count
        assert cases.failures(result["cases"]) == [], f"rank {rank}"
        fp32 = {key: value for key, value in result["fused"].items() if "float32" in key}
        fp64 = {key: value for key, value in result["fused"].items() if "float64" in key}
        assert len(fp32) == len(cases.LOSS_CONFIGS) * (1 + len(cases.padding_cases(64, tp_size)))
        assert max(fp32.values()) <= 1e-5, (rank, fp32)
        assert max(fp64.values()) <= 1e-10, (rank, fp64)
        ids, expected_ids = result["topk"]
        assert ids == expected_ids, f"rank {rank}"
