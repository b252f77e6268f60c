"""The ``hf`` rollout engine in the real trainer (issue #32 item 2): the tiny preset under torchrun with a TP=1 student
on 2 ranks (DP=2), each rank an ``hf`` replica sampling its half of the prompts, 3 sync steps. Every step's weight
sync is verified (``weight_sync.verify``: the engine's prompt log-probs equal the student's forward within 1e-4, or
the run fails), so the engine samples with the weights just trained; the rollout metrics are logged. With a TP=2
student (slow tier) each rank's whole model is assembled from both ranks' shards."""

import math

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

HF_ROLLOUT = ["rollout.engine=hf", "rollout.tensor_parallel_size=1", "rollout.kv_cache_memory_mb=null",
              "trainer.scheduler=sync", "trainer.num_steps=3", "weight_sync.verify=true", "eval.at_start=false",
              "eval.at_end=false", "checkpoint.save_interval=null", "checkpoint.save_at_end=false",
              "checkpoint.hf_at_end=false"]


@pytest.mark.parametrize("student_tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_three_steps_sample_with_the_hf_engine_and_its_weights_stay_current(assets, tmp_path, student_tp):
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + HF_ROLLOUT
                            + [f"parallel.tensor_model_parallel_size={student_tp}"])
    assert code == 0, log[-4000:]
    assert "vllm" not in log.lower()  # no vLLM engine was started
    steps = harness.steps(out)
    assert len(steps) == 3 and all(math.isfinite(r["train/loss"]) for r in steps)
    # Sync scheduler: step s samples with the weights of s updates, synced (and verified) before it.
    assert [r["train/weight_version"] for r in steps] == [0.0, 1.0, 2.0]
    assert "time/weight_sync" not in steps[0] and all(r["time/weight_sync"] > 0 for r in steps[1:])
    for record in steps:
        # The engine check (weight_sync.check_interval): the engine's log-probs of its tokens are the trainer's.
        assert record["engine/tokens"] > 0 and record["engine/mean_abs_error"] < 1e-4, record
        assert abs(record["mismatch/kl_k1"]) < 1e-5 and record["mismatch/max_ratio"] < 1.001, record
        assert record["time/rollout"] > 0 and record["rollout/num_tokens"] > 0
        assert 0 < record["rollout/response_length_mean"] <= 24
