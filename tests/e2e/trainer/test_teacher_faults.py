"""Teacher faults during a run: a worker killed while it holds a request is retried on another and the
run goes on; every teacher down past the deadline stops the run with a clear error after the last
complete step (checkpointed), and no step is trained on missing teacher data."""

import time

import pytest

from megatron_gkd.testing import runs as harness
from tests.e2e.teacher import procs

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

OFF_POLICY = ["teacher.serve.model=null", "trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4",
              "eval.at_start=false", "eval.at_end=false", "checkpoint.hf_at_end=false"]


@pytest.fixture()
def proxy_and_workers(tmp_path):
    with procs.proxy_and_workers(tmp_path) as cluster:
        yield cluster


def _wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.1)


@pytest.mark.slow  # suite time; tests/e2e/teacher/test_faults.py retries past a killed worker in the default tier
def test_a_killed_worker_is_retried_and_the_run_goes_on(proxy_and_workers, assets, tmp_path):
    proxy, start_worker = proxy_and_workers
    worker_a, markers_a = start_worker("a", assets / "teacher", delay_s=60.0)
    out = tmp_path / "run"
    run = harness.start(out, harness.asset_overrides(assets) + OFF_POLICY + [
        f"teacher.address={proxy.frontend_address}", "trainer.num_steps=4", "teacher.attempt_timeout_s=60"])
    _wait(lambda: any(markers_a.iterdir()), 300, f"no request reached worker A: {harness.tail(run)}")
    worker_b, markers_b = start_worker("b", assets / "teacher")
    procs.stop(worker_a, kill=True)  # it holds the run's first request
    assert harness.wait(run, 600) == 0, harness.tail(run)
    assert [r["step"] for r in harness.steps(out)] == [1, 2, 3, 4]
    assert any(markers_b.iterdir())


def test_all_teachers_down_stops_after_the_last_complete_step(proxy_and_workers, assets, tmp_path):
    proxy, start_worker = proxy_and_workers
    worker, _ = start_worker("only", assets / "teacher")
    out = tmp_path / "run"
    run = harness.start(out, harness.asset_overrides(assets) + OFF_POLICY + [
        f"teacher.address={proxy.frontend_address}", "trainer.num_steps=50", "checkpoint.save_interval=1",
        "teacher.attempt_timeout_s=3", "teacher.deadline_s=10", "teacher.max_attempts=3"])
    harness.wait_for_steps(out, 2, run)
    procs.stop(worker, kill=True)
    code = harness.wait(run, 600)
    log = run.log_path.read_text()
    assert code != 0 and "[unavailable]" in log, log[-3000:]
    trained = [r["step"] for r in harness.steps(out)]
    assert trained == list(range(1, len(trained) + 1)) and 2 <= len(trained) < 50
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"iter_{trained[-1]:07d}"  # the last complete step is saved; nothing after it ran
    assert "saving the last complete step" in log
