"""Partial rollouts end to end (``trainer.scheduler=partial``, the tiny preset under torchrun, colocated vLLM TP=2, the
teacher service the run starts) on a task of skewed response lengths: unfinished samples are carried over weight
updates, the loss sees each token's weight version, every admitted prompt group is trained once or is still in the
buffer, and a run killed with unfinished samples in its buffer resumes with the same buffer (the same groups, prompts
and losses as the uninterrupted run). ``partial_one_step_off`` samples one update ahead: every token is at least one
version old, and every group is still trained once; killed with unfinished samples in its buffer, it re-samples the
batch that was in flight from the buffer that batch started from (with the checkpoint's weights, so its groups and
losses may differ from the uninterrupted run's from there on, as ``one_step_off``'s in-flight batch does), and no group
is lost or trained twice."""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

PARTIAL = harness.SKEWED_LENGTHS + [
    "trainer.scheduler=partial", "rollout.partial.chunk_tokens=8", "rollout.max_tokens=48", "trainer.num_steps=6",
    "trainer.deterministic=true", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=2",
    "checkpoint.keep_last_n=10", "checkpoint.hf_at_end=false", "checkpoint.save_at_end=false"]
ONE_STEP_OFF = [o for o in PARTIAL if not o.startswith("trainer.scheduler=")] + ["trainer.scheduler=partial_one_step_off"]


@pytest.fixture(scope="module")
def partial_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("partial") / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + PARTIAL)
    assert code == 0, log[-4000:]
    return out


@pytest.fixture(scope="module")
def one_step_off_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("partial_one_step_off") / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + ONE_STEP_OFF)
    assert code == 0, log[-4000:]
    return out


def _killed_and_resumed(out, overrides, assets, expected: list[dict]) -> tuple[int, list[dict]]:
    """Runs ``overrides`` into ``out``, SIGKILLs torchrun and every rank once 3 steps are logged, runs the same
    command again to the end; returns the step it resumed at (a checkpoint every 2 steps: 2 or 4) and the step
    records. ``expected``, the uninterrupted run's records, must show unfinished samples in the checkpoint's buffer."""
    process = harness.start(out, overrides, log_name="killed.log")
    harness.wait_for_steps(out, 3, process)
    harness.stop(process)
    process.wait()
    assert harness.wait_until(lambda: not harness.leftover_processes(str(assets / "teacher")), 60)
    code, log = harness.run(out, overrides, log_name="resumed.log")
    assert code == 0, log[-4000:]
    resumed_at = int(log.split("resumed at step ")[1].split()[0])
    assert resumed_at in (2, 4), resumed_at
    assert expected[resumed_at - 1]["rollout/partial/carried_samples"] > 0, "the checkpoint's buffer held nothing unfinished"
    got = harness.steps(out)
    assert [r["step"] for r in got] == list(range(1, 7))
    return resumed_at, got


def _trained_once_or_buffered(steps) -> None:
    """Asserts that the admitted groups' uids count up from 0 and that each one was trained once or is still in the
    buffer at the end."""
    trained = [uid for r in steps for uid in r["rollout/partial/trained_uids"]]
    admitted = [uid for r in steps for uid in r["rollout/partial/admitted_uids"]]
    assert len(trained) == len(set(trained)) == len(steps) * 4  # four prompt groups a step, none twice
    assert set(trained) <= set(admitted) == set(range(len(admitted)))
    assert len(admitted) - len(trained) == steps[-1]["rollout/partial/buffer_groups"]  # the rest: still buffered


def test_carried_samples_reach_the_loss_with_their_versions_and_no_group_is_lost(partial_run):
    steps = harness.steps(partial_run)
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert any(r["rollout/partial/carried_samples"] > 0 for r in steps[:-1]), "nothing was carried: the task is not skewed"
    for r in steps:
        # The loss's own staleness statistics (from the micro-batches' token versions) agree with the batch's.
        assert r["train/token_staleness_max"] == r["rollout/partial/token_staleness_max"] == r["train/staleness"]
        assert r["train/token_staleness_mean"] == pytest.approx(r["rollout/partial/token_staleness_mean"], abs=1e-9)
        assert r["rollout/partial/masked_tokens"] == 0
    assert max(r["train/token_staleness_max"] for r in steps) >= 1, "no token was trained after a weight update"
    _trained_once_or_buffered(steps)


@pytest.mark.slow  # two more runs of the preset (about 70 s)
def test_a_run_killed_with_unfinished_samples_resumes_with_the_same_buffer(partial_run, assets, tmp_path):
    expected = harness.steps(partial_run)
    resumed_at, got = _killed_and_resumed(tmp_path / "run", harness.asset_overrides(assets) + PARTIAL, assets, expected)
    for key in ("rollout/partial/trained_uids", "rollout/partial/admitted_uids", "prompts",
                "rollout/partial/token_staleness_mean"):
        assert [r[key] for r in got] == [r[key] for r in expected], key
    for mine, theirs in zip(got[resumed_at:], expected[resumed_at:]):
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], abs=1e-6), mine["step"]


@pytest.mark.slow  # suite time: the partial rollout itself is checked by the default tier's first test (about 20 s)
def test_partial_one_step_off_samples_a_batch_ahead_and_trains_every_group_once(one_step_off_run):
    steps = harness.steps(one_step_off_run)
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps[1:]:  # batch i was sampled before update i-1: its newest tokens are one version old
        assert r["train/token_staleness_mean"] >= 1 and r["train/token_staleness_max"] == r["train/staleness"] >= 1
    _trained_once_or_buffered(steps)


@pytest.mark.slow  # two more runs of the preset (40-60 s)
def test_partial_one_step_off_killed_with_unfinished_samples_resamples_the_batch_in_flight(one_step_off_run, assets,
                                                                                           tmp_path):
    expected = harness.steps(one_step_off_run)
    # The checkpoint after step s keeps batch s's data position (sampled before update s-1, not trained): the buffer
    # after batch s-1's rounds, which the record of step s describes.
    resumed_at, got = _killed_and_resumed(tmp_path / "run", harness.asset_overrides(assets) + ONE_STEP_OFF, assets,
                                          expected)
    # After the resume batch s is sampled again from that buffer, now with weights s (its new tokens are not a version
    # old; its groups and losses may differ from the uninterrupted run's); later batches are a step ahead again.
    for r in got[resumed_at + 1:]:
        assert r["train/token_staleness_mean"] >= 1 and r["train/token_staleness_max"] == r["train/staleness"] >= 1
    # Across the kill every group is trained once or still buffered, and a uid names the same prompt in both runs
    # (the sampler resumed at the buffer's position).
    _trained_once_or_buffered(got)
    mine, theirs = [{uid: prompt for r in steps for uid, prompt in zip(r["rollout/partial/trained_uids"], r["prompts"])}
                    for steps in (got, expected)]
    both = mine.keys() & theirs.keys()
    assert {uid: mine[uid] for uid in both} == {uid: theirs[uid] for uid in both}
