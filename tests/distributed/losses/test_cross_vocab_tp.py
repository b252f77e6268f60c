"""The cross-tokenizer loss at TP=2 (gloo ranks) against the dense float64 reference and against TP=1 (TP=4 is
simulated in one process in tests/unit/losses/test_cross_vocab.py).

One spawn per test runs every case x divergence x method (projected, hybrid) x dtype inside the ranks, unfused and
fused (hidden @ W^T in token chunks); the
parent asserts on the collected errors, so a failure names the case, loss, method and dtype. The case
'preimages_on_every_shard' reaches every teacher id from several shards: it fails if the reduction over TP is
dropped.
"""

import pytest

from megatron_gkd.testing import cross_vocab as cases
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

TOLERANCE = {"torch.float64": 1e-12, "torch.float32": 1e-5}


@pytest.mark.parametrize("tp_size", [2])
def test_cross_vocab_loss_matches_reference_and_tp1(tp_size):
    per_rank = run_distributed(cases.check_tp, tp_size)
    expected_count = len(cases.make_cases()) * len(cases.LOSS_CONFIGS) * 2 * 2
    for rank, results in enumerate(per_rank):
        assert len(results) == expected_count
        failed = [
            row for row in results
            if max(row["loss_vs_reference"], row["grad_vs_reference"], row["loss_vs_tp1"], row["grad_vs_tp1"])
            > TOLERANCE[row["dtype"]] or not row["metrics_finite"]
        ]
        assert failed == [], f"rank {rank}: {failed[:3]}"


@pytest.mark.parametrize("tp_size", [2])
def test_fused_cross_vocab_loss_matches_reference(tp_size):
    per_rank = run_distributed(cases.check_fused_tp, tp_size)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(cases.make_cases()) * len(cases.LOSS_CONFIGS) * 2 * 2
        failed = [row for row in results
                  if max(row["loss"], row["grad_hidden"], row["grad_weight"]) > TOLERANCE[row["dtype"]]]
        assert failed == [], f"rank {rank}: {failed[:3]}"


@pytest.mark.parametrize("thresholds", [(4, 0.5), (0, 0.0)], ids=["some_heavy", "all_heavy"])
def test_heavy_ids_match_reference(thresholds):
    """The heavy teacher ids' dense product (megatron_gkd.losses.cross_vocab.heavy) at TP=2, unfused and fused, on
    maps whose ids 0-2 are reached from most student tokens of both shards."""
    per_rank = run_distributed(cases.check_heavy_tp, 2, args=thresholds)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(cases.make_heavy_cases()) * len(cases.LOSS_CONFIGS) * 2 * 2
        picked = {tuple(row["heavy_ids"]) for row in results}  # this rank's heavy ids: some of 0-2, or many
        assert all(0 < len(ids) and (set(ids) <= {0, 1, 2} if thresholds == (4, 0.5) else len(ids) > 3)
                   for ids in picked), picked
        failed = [row for row in results
                  if max(value for key, value in row.items() if isinstance(value, float)) > TOLERANCE[row["dtype"]]]
        assert failed == [], f"rank {rank}: {failed[:3]}"
