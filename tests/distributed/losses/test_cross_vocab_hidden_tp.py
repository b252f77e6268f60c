"""The cross-tokenizer loss from the teacher's hidden states at TP=2 (gloo ranks): both vocabularies split, against
the dense float64 reference and against TP=1, every divergence, with and without padding rows."""

import pytest

from megatron_gkd.testing import cross_vocab as cases
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

TOLERANCE = {"torch.float64": 1e-12, "torch.float32": 1e-5}


def test_hidden_cross_vocab_loss_matches_reference_and_tp1():
    per_rank = run_distributed(cases.check_hidden_tp, 2)
    for rank, results in enumerate(per_rank):
        assert len(results) == 2 * len(cases.LOSS_CONFIGS) * 2
        failed = [row for row in results
                  if max(row["loss_vs_reference"], row["grad_vs_reference"], row["loss_vs_tp1"], row["grad_vs_tp1"])
                  > TOLERANCE[row["dtype"]]]
        assert failed == [], f"rank {rank}: {failed[:3]}"
