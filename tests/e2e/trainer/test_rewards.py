"""Rewards in a run of the real entry point: computed beside the teacher request and logged per step
(``reward/mean``, ``reward/min``, ``reward/max``, ``time/reward_wait``); a user reward that raises, returns NaN,
hangs past ``reward.timeout_s`` or returns a wrong length stops every rank with a message naming the function
and the record, after the last complete step (checkpointed), as a failed teacher does."""

import json
import re

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

FUNCTIONS = "tests.e2e.trainer.reward_functions"
# Off-policy on the dataset's responses (no rollout engine): the cheapest run that has a teacher request.
OFF_POLICY = ["trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
              "eval.at_start=false", "eval.at_end=false", "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0"]


def test_final_answer_rewards_are_logged_every_step(assets, tmp_path):
    out = tmp_path / "run"
    # The tiny vocabulary has no '####' (every final answer scores 0): a format reward for responses that contain
    # the word w1... gives the rewards values to check against the dataset.
    # DP=2: each data-parallel share is rewarded on its own rank; the metrics cover the global batch.
    code, log = harness.run(out, harness.asset_overrides(assets) + OFF_POLICY + [
        "parallel.tensor_model_parallel_size=1", "trainer.num_steps=3", "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false", "reward.kind=final_answer", r"reward.format_pattern='\bw1'",
        "reward.format_coef=0.5"])
    assert code == 0, log[-4000:]
    responses = [json.loads(line)["response"] for line in (assets / "train.jsonl").read_text().splitlines()]
    steps = harness.steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        expected = [0.5 if re.search(r"\bw1", responses[index]) else 0.0 for index in record["prompts"]]
        assert record["reward/count"] == 4.0  # every sample of the global batch, from both ranks
        assert record["reward/mean"] == pytest.approx(sum(expected) / 4)
        assert (record["reward/min"], record["reward/max"]) == (min(expected), max(expected))
        assert record["time/reward_wait"] >= 0.0
    assert any(0 < r["reward/mean"] < 0.5 for r in steps)  # batches of rewarded and unrewarded responses


def _overrides(assets, function: str, *extra: str) -> list[str]:
    return harness.asset_overrides(assets) + OFF_POLICY + [
        "trainer.num_steps=6", "checkpoint.save_interval=1", "reward.kind=function",
        f"reward.function={FUNCTIONS}:{function}", *extra]


def _fails_after_two_steps(assets, tmp_path, function: str, *extra: str) -> str:
    out = tmp_path / "run"
    code, log = harness.run(out, _overrides(assets, function, *extra))
    assert code != 0, log[-4000:]
    assert f"RewardFailed: reward '{FUNCTIONS}:{function}'" in log, log[-4000:]
    assert [r["step"] for r in harness.steps(out)] == [1, 2]  # no step is trained on a missing reward
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert "saving the last complete step (2)" in log
    return log


def test_a_reward_that_raises_stops_the_run_and_its_batch_is_trained_after_the_resume(assets, tmp_path):
    log = _fails_after_two_steps(assets, tmp_path, "raises_on_third")
    assert "raised ValueError: the grader cannot parse this response on record 0 of 4 (id " in log, log[-4000:]
    assert "PeerFailure: rank 0 failed, so every rank stops" in log  # the rank without a runner stops too
    # Rerunning the command (the grader mended) resumes at step 2 and trains the failed batch as step 3, exactly as a
    # run that never failed does (issue #48: the saved data position was the next batch's, so it was skipped).
    code, log = harness.run(tmp_path / "run", _overrides(assets, "ones", "trainer.num_steps=4"), log_name="resumed.log")
    assert code == 0, log[-4000:]
    reference = tmp_path / "reference"
    code, log = harness.run(reference, _overrides(assets, "ones", "trainer.num_steps=4", "checkpoint.save_interval=null"),
                            log_name="reference.log")
    assert code == 0, log[-4000:]
    resumed = {r["step"]: (r["prompts"], r["train/loss"]) for r in harness.steps(tmp_path / "run")}
    expected = {r["step"]: (r["prompts"], r["train/loss"]) for r in harness.steps(reference)}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert resumed[step][0] == expected[step][0], (step, resumed[step][0], expected[step][0])
        assert resumed[step][1] == pytest.approx(expected[step][1], rel=1e-5), step


@pytest.mark.slow  # suite time: the default tier has the raising reward
def test_a_nan_reward_stops_the_run(assets, tmp_path):
    log = _fails_after_two_steps(assets, tmp_path, "nan_on_third")
    assert "returned nan for record 1 of 4 (id " in log and "rewards must be finite" in log, log[-4000:]


@pytest.mark.slow
def test_a_reward_past_its_timeout_stops_the_run(assets, tmp_path):
    log = _fails_after_two_steps(assets, tmp_path, "hangs_on_third", "reward.timeout_s=3")
    assert "gave no rewards within reward.timeout_s=3.0 s for a batch of 4 records (ids " in log, log[-4000:]


@pytest.mark.slow
def test_a_reward_of_the_wrong_length_stops_the_run(assets, tmp_path):
    log = _fails_after_two_steps(assets, tmp_path, "short_on_third")
    assert "returned 3 values for a batch of 4 records (ids " in log, log[-4000:]


@pytest.mark.slow  # a vLLM rollout server: minutes
def test_rewards_of_responses_sampled_on_the_rollout_server(assets, tmp_path):
    """The disaggregated layout sends the rewards from the rollout thread, beside its teacher request."""
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + [
        "rollout.layout=disaggregated", "weight_sync.transport=distributed", "rollout.tensor_parallel_size=1",
        "trainer.scheduler=one_step_off", "trainer.num_steps=3", "eval.at_start=false", "eval.at_end=false",
        "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "checkpoint.save_interval=null",
        "reward.kind=regex", "reward.pattern=w"])
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:  # 16 samples; a response without any word (EOS at once) gets 0
        assert record["reward/count"] == 16.0 and 0.0 <= record["reward/min"] <= record["reward/max"] == 1.0, record
        assert "time/reward_wait" in record
