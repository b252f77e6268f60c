"""Rewards with the teacher's signal in a run of the real entry point (``rl.combine``): the tiny preset's vLLM
rollout, one_step_off scheduler, TP=2 student and served teacher, a regex verifier; every step logs the
policy-gradient term, the teacher's part and the rollout-trainer mismatch, and the figures add up."""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# Responses that name one of the words w10..w19 score 1: about a third of the tiny task's samples, so most prompt
# groups hold both rewards and GRPO's advantages are not all 0.
REWARD = ["reward.kind=regex", r"reward.pattern='\bw1\d\b'"]
SHORT = ["trainer.num_steps=3", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
         "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false"]


def _steps(assets, tmp_path, *overrides):
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + SHORT + REWARD + list(overrides))
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    return steps


def _common(record):
    assert record["reward/count"] == 16.0 and 0.0 <= record["reward/mean"] <= 1.0
    assert record["train/num_loss_tokens"] == record["rollout/num_tokens"]
    # the sampler's and the trainer's log-probs of the same tokens: close (the same weights, one step stale at most)
    assert 0 <= record["mismatch/kl_k3"] < 0.05 and abs(record["mismatch/kl_k1"]) < 0.05
    assert 1.0 <= record["mismatch/max_ratio"] < 2.0 and 1.0 <= record["mismatch/max_inverse_ratio"] < 2.0
    assert record["time/reward_wait"] >= 0.0


def test_loss_side_combination_with_vllm_and_one_step_off(assets, tmp_path):
    steps = _steps(assets, tmp_path, "rl.combine=loss", "rl.kd_coef=0.5", "rl.tis_cap=2.0")
    assert steps[1]["train/staleness"] == 1.0  # one_step_off: trained on samples of the previous weights
    for record in steps:
        _common(record)
        assert record["train/loss"] == pytest.approx(record["pg/loss"] + record["train/kd_loss"], rel=1e-6)
        assert record["train/kd_loss"] > 0 and 0 < record["pg/tis_weight"] <= 2.0
    assert any(record["pg/advantage"] != 0.0 for record in steps)
    assert any(0.0 < record["reward/mean"] < 1.0 for record in steps)


@pytest.mark.slow  # suite time: the loss side runs the same path in the default tier
@pytest.mark.parametrize("combine", ["advantage", "teacher"])
def test_the_teacher_in_the_advantage(assets, tmp_path, combine):
    steps = _steps(assets, tmp_path, f"rl.combine={combine}", "rl.kl_estimator=k1")
    for record in steps:
        _common(record)
        assert record["train/kd_loss"] == 0.0 and record["pg/teacher_kl"] > 0
        assert record["train/loss"] == pytest.approx(record["pg/loss"], rel=1e-6)
        if combine == "teacher":  # reward 0: the advantage is the teacher's alone
            assert record["pg/advantage"] == pytest.approx(-record["pg/teacher_kl"], rel=1e-5)
