"""Killed runs resume where they were. kill -9 at a random step of the deterministic reference run, then
the same command: the losses after the resume equal the uninterrupted run's and the trained prompts are
the same sequence (nothing skipped or repeated). SIGTERM (Slurm preemption) under one_step_off: a
checkpoint, exit 0; the batch in flight is re-sampled after the resume, never lost or doubled."""

import random
import signal

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


def _prompts(out):
    return [r["prompts"] for r in harness.steps(out)]


def test_kill_9_then_resume_matches_the_uninterrupted_run(sync_run, assets, tmp_path):
    reference, _ = sync_run
    expected = harness.steps(reference)
    out = tmp_path / "run"
    overrides = harness.asset_overrides(assets) + harness.SYNC_RUN
    kill_after = random.Random().randint(3, 15)
    process = harness.start(out, overrides, log_name="killed.log")
    harness.wait_for_steps(out, kill_after, process)
    harness.stop(process)  # SIGKILL to torchrun and every rank
    process.wait()
    assert harness.wait_until(lambda: not harness.leftover_processes(str(assets / "teacher")), 60), \
        "the teacher service outlived its killed run"
    killed_at = len(harness.steps(out))
    code, log = harness.run(out, overrides, log_name="resumed.log")
    assert code == 0, log[-4000:]
    resumed_at = int(log.split("resumed at step ")[1].split()[0])
    assert kill_after <= killed_at and resumed_at in (killed_at - 1, killed_at), (killed_at, resumed_at)
    got = harness.steps(out)
    assert _prompts(out) == [r["prompts"] for r in expected]
    for mine, theirs in zip(got[resumed_at:], expected[resumed_at:]):
        assert mine["step"] == theirs["step"]
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], abs=1e-6), mine["step"]


@pytest.mark.slow  # suite time; the kill -9 resume above stays in the default tier
def test_sigterm_checkpoints_and_the_in_flight_batch_is_resampled(sync_run, assets, tmp_path):
    reference, _ = sync_run
    out = tmp_path / "run"
    overrides = harness.asset_overrides(assets) + [
        "trainer.scheduler=one_step_off", "trainer.num_steps=8", "eval.at_start=false", "eval.at_end=false",
        "checkpoint.save_interval=null", "checkpoint.hf_at_end=false"]
    process = harness.start(out, overrides, log_name="preempted.log")
    harness.wait_for_steps(out, 3, process)
    for pid in harness.worker_pids(out):
        harness.os.kill(pid, signal.SIGTERM)
    assert harness.wait(process, 300) == 0, harness.tail(process)
    log = process.log_path.read_text()
    stopped = len(harness.steps(out))
    assert "stopped by signal" in log and (out / "checkpoints" / f"iter_{stopped:07d}").is_dir()
    code, log = harness.run(out, overrides, log_name="resumed.log")
    assert code == 0, log[-4000:]
    assert f"resumed at step {stopped}" in log
    # The batch sampled ahead when the signal came is drawn again: same prompts, in order, once each.
    assert _prompts(out) == _prompts(reference)[:8]
