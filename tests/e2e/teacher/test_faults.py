"""Faults with real worker processes: behind an in-process proxy (kill, stop all, restart), the
replicas of `serve --num-workers 2` (one killed while it holds a request), and a run's service killed with a request in
flight (its keeper starts it again on the same address)."""

import os
import signal
import time

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.config import TeacherServeConfig
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.local import ServiceKeeper, TeacherService
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher
from tests.e2e.teacher import procs

pytestmark = pytest.mark.e2e

# Worker A holds a request until it is killed: the test kills it long before this, so how fast any
# process starts cannot let A finish first.
HOLD_S = 3600.0
# Longer than the whole test: the first attempt can end only by the proxy reporting A's death, never
# by timing out (a 6 s timeout once expired while B was still starting under load, and the timed-out
# retry had finished on B before A could be killed).
NEVER_S = 600.0


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_teacher(tmp_path_factory.mktemp("tiny_teacher"), num_layers=1)


@pytest.fixture()
def cluster(tmp_path):
    """An in-process proxy on loopback plus a way to start worker processes; all stopped at the end."""
    with procs.proxy_and_workers(tmp_path) as cluster:
        yield cluster


def _wait_for(predicate, timeout_s: float):
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


def _batch():
    rng = np.random.default_rng(1)
    return ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(3, 512, n), response_start=s)
                                 for n, s in ((12, 5), (7, 1), (20, 19))], top_k=16)


def test_kill_worker_mid_request_stop_all_then_restart(cluster, teacher_dir):
    proxy, start_worker = cluster
    reference = ReferenceTeacher(teacher_dir)
    batch = _batch()
    retry = RetryPolicy(attempt_timeout_s=NEVER_S, deadline_s=NEVER_S, max_attempts=8, backoff_s=0.2)
    with build_client("zmq", address=proxy.frontend_address, retry=retry) as client:
        # 1. Worker A takes the request; B joins; A is killed while busy; a retry lands on B.
        worker_a, markers_a = start_worker("a", teacher_dir, delay_s=HOLD_S)
        client.info()  # A is registered (info needs no backend work, so A answers it at once)
        retries_before = client.num_retries
        future = client.score_async(batch)
        _wait_for(lambda: any(markers_a.iterdir()), 60)
        worker_b, markers_b = start_worker("b", teacher_dir, delay_s=0.0)
        # Checked before the kill: the proxy reports A's death to the client at once, so the retry
        # on B may be done by the time the kill has been waited for.
        assert not future.done(), "worker A must still hold the request when it is killed"
        procs.stop(worker_a, kill=True)
        assert worker_a.returncode is not None
        # Well under the attempt timeout: only the proxy's report of A's death can end attempt 1.
        outputs = future.result(timeout=150)
        assert client.num_retries - retries_before == 1, "one retry, caused by A's death, not by a timeout"
        assert any(markers_b.iterdir()), "the retried request must have been served by worker B"
        for output, sequence in zip(outputs, batch.sequences, strict=True):
            reference.assert_matches(output, sequence.token_ids, sequence.response_start, batch.top_k)

        # 2. All workers stopped: a clear error once the deadline passes, and no data at all.
        procs.stop(worker_b)
    short = RetryPolicy(attempt_timeout_s=1.5, deadline_s=5, max_attempts=10, backoff_s=0.2)
    with build_client("zmq", address=proxy.frontend_address, retry=short) as client:
        future = client.score_async(batch)
        error = future.exception(timeout=60)
        assert isinstance(error, TeacherError) and error.code == ErrorCode.UNAVAILABLE
        assert "within 5 s" in str(error) and "workers connected" in str(error)
        with pytest.raises(TeacherError):
            future.result()

        # 3. A restarted worker serves the next request.
        start_worker("c", teacher_dir, delay_s=None)
    with build_client("zmq", address=proxy.frontend_address, retry=retry) as client:
        outputs = client.score(batch)
    for output, sequence in zip(outputs, batch.sequences, strict=True):
        reference.assert_matches(output, sequence.token_ids, sequence.response_start, batch.top_k)


def _served_by(marker_dir) -> set[int]:
    """Pids of the workers that received a request (from the slow backend's marker files)."""
    return {int(marker.name.split("-")[0]) for marker in marker_dir.iterdir()}


@pytest.mark.slow  # two worker processes load the model: about 3 min on a loaded 2-core machine
def test_serve_with_two_replicas_survives_a_killed_one(tmp_path, teacher_dir):
    """``serve --num-workers 2``: the replica holding a request is killed; the request is retried on
    the other replica and the service keeps serving."""
    reference = ReferenceTeacher(teacher_dir)
    secret_file, secret = procs.write_secret(tmp_path)
    markers, hold = tmp_path / "markers", tmp_path / "hold"
    markers.mkdir()
    hold.touch()  # the first request is held by whichever replica takes it
    service = procs.start(
        ["launch/teacher_server.py", "serve", "--frontend", "tcp://127.0.0.1:0", "--num-workers", "2",
         "--model", str(teacher_dir), "--secret-file", str(secret_file),
         "--backend-module", "tests.e2e.teacher.slow_backend", "--backend", "hf_slow",
         "--backend-arg", f"marker_dir={markers}", "--backend-arg", f"delay_s={HOLD_S}",
         "--backend-arg", f"hold_file={hold}"],
        "READY frontend=", 300, tmp_path / "serve.log")
    try:
        address = service.ready_line.split("frontend=")[1].split()[0]
        batch = _batch()
        retry = RetryPolicy(attempt_timeout_s=NEVER_S, deadline_s=NEVER_S, max_attempts=4, backoff_s=0.2)
        with build_client("zmq", address=address, secret=secret, retry=retry) as client:
            future = client.score_async(batch)
            _wait_for(lambda: any(markers.iterdir()), 60)
            hold.unlink()  # later requests are answered at once
            (held_by,) = _served_by(markers)
            assert not future.done()
            os.kill(held_by, signal.SIGKILL)
            # Only the proxy's report of the killed replica can end the first attempt (NEVER_S).
            outputs = future.result(timeout=150)
            assert client.num_retries == 1
            (other,) = _served_by(markers) - {held_by}
            for output, sequence in zip(outputs, batch.sequences, strict=True):
                reference.assert_matches(output, sequence.token_ids, sequence.response_start, batch.top_k)
            # The service serves on with one replica.
            for _ in range(3):
                client.score(batch)
            assert _served_by(markers) == {held_by, other}
        assert service.poll() is None
        _wait_for(lambda: "exited with code -9; 1 of 2 workers serve on" in service.log_path.read_text(), 30)
    finally:
        procs.stop(service)


def test_a_run_s_teacher_service_killed_with_a_request_in_flight_is_started_again_on_its_address(tmp_path, teacher_dir):
    """Issue #48 item 4: the trainer's :class:`ServiceKeeper` replaces a teacher service of the run that dies by a new
    one on the same address with the same secret; the client's next attempt reaches it and gets the whole answer.
    Without the keeper the request fails past its deadline (``TeacherError``: unavailable)."""
    reference = ReferenceTeacher(teacher_dir)
    serve = TeacherServeConfig(model=str(teacher_dir), delay_s=2.0, max_restarts=1)
    service = TeacherService(serve, tmp_path / "teacher_service.log")
    address = service.wait_ready(300)
    keeper = ServiceKeeper({"teacher": (service, address)})
    try:
        batch = _batch()
        retry = RetryPolicy(attempt_timeout_s=5.0, deadline_s=60.0, max_attempts=10, backoff_s=0.2)
        with build_client("zmq", address=address, secret=service.secret.encode(), retry=retry) as client:
            future = client.score_async(batch)  # held 2 s by the service's delay
            time.sleep(0.5)
            os.kill(service.process.pid, signal.SIGKILL)
            outputs = future.result(timeout=150)
            assert client.num_retries >= 1
            for output, sequence in zip(outputs, batch.sequences, strict=True):
                reference.assert_matches(output, sequence.token_ids, sequence.response_start, batch.top_k)
        assert keeper.restarts == {"teacher": 1}
        replacement = keeper.service("teacher")
        assert replacement is not service and replacement.process.poll() is None
        assert (tmp_path / "teacher_service.1.log").exists()
    finally:
        keeper.stop()
    assert replacement.process.poll() is not None  # the keeper stops the service it started
