"""The policy-gradient term at TP=2 (gloo ranks) against the dense float64 reference and TP=1: every case (clip
regimes, dual clip, importance-sampling caps, padding rows and a shard of padding only, tokens all in one shard,
the [s, b] layout), unfused in fp64/fp32/bf16 and fused in fp64/fp32, plus the mismatch metrics pooled over the
group. One spawn runs everything; the parent asserts on the collected errors."""

import pytest
import torch

from megatron_gkd.testing import policy_gradient as cases
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def test_policy_gradient_at_tp2_matches_the_reference_and_tp1():
    per_rank = run_distributed(cases.check_everything, 2)
    num_cases = len(cases.make_cases(2))
    for rank, result in enumerate(per_rank):
        records = result["records"]
        assert len(records) == num_cases * (len(cases.UNFUSED_DTYPES) + len(cases.FUSED_DTYPES))
        assert cases.failures(records) == [], f"rank {rank}"
        fp64 = [max(r["loss_error"], r["grad_error"]) * cases.TOLERANCES[torch.float64]
                for r in records if r["dtype"] == str(torch.float64)]
        assert max(fp64) < 1e-13, (rank, max(fp64))
        assert all(error < 1e-12 for error in result["mismatch"].values()), (rank, result["mismatch"])
