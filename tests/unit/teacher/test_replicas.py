"""Teacher replicas in one process: the proxy's load balancing over workers, and split requests.

Which worker served each request is recorded by the worker's backend (a request is tagged by its first
token), so the tests assert who served what, never how long anything took.
"""

import threading
import time

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.backends import TeacherBackend, build_backend
from megatron_gkd.teacher.clients.zmq_client import split_sequences
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher
from tests.unit.teacher.conftest import LIMITS, SECRET

RETRY = RetryPolicy(attempt_timeout_s=60, deadline_s=120, max_attempts=3, backoff_s=0.05)
FAIL_TAG = 7  # a request whose first token is this is refused (bad_request: never retried)


class Recording(TeacherBackend):
    """The shared hf backend, recording the tag (first token) of every request it scores.

    ``gate``: each request waits for it (a busy replica); ``barrier``: requests wait for each other
    (proves they are scored at the same time).
    """

    def __init__(self, backend, gate: threading.Event | None = None, barrier: threading.Barrier | None = None):
        self._backend, self._gate, self._barrier = backend, gate, barrier
        self.tags, self.started = [], threading.Event()

    def info(self):
        return self._backend.info()

    def score(self, batch):
        tag = int(batch.sequences[0].token_ids[0])
        self.tags.append(tag)
        self.started.set()
        if self._gate is not None:
            assert self._gate.wait(60), "the test never released this replica"
        if self._barrier is not None:
            self._barrier.wait()
        if tag == FAIL_TAG:
            raise TeacherError(ErrorCode.BAD_REQUEST, "refused by the test")
        return self._backend.score(batch)


@pytest.fixture(scope="module")
def hf(teacher_dir):
    return build_backend("hf", model=str(teacher_dir))


@pytest.fixture(scope="module")
def reference(teacher_dir):
    return ReferenceTeacher(teacher_dir)


@pytest.fixture()
def proxy():
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    workers = []

    def add_worker(backend):
        count = proxy.num_workers
        workers.append(Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS).start())
        _wait_for(lambda: proxy.num_workers == count + 1)

    yield proxy, add_worker
    for worker in workers:
        worker.close()
    proxy.close()


def _wait_for(predicate, timeout_s: float = 60):
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def _batch(tags, lengths=(9, 14, 6, 20, 11, 8)) -> ScoreBatch:
    """One sequence per tag (its first token), of distinct lengths so a misplaced output shows."""
    rng = np.random.default_rng(len(tags))
    sequences = []
    for tag, length in zip(tags, lengths, strict=False):
        ids = rng.integers(10, 512, length)
        ids[0] = tag
        sequences.append(SequenceRequest(token_ids=ids, response_start=length // 3 + 1))
    return ScoreBatch(sequences=sequences, top_k=8)


def test_requests_go_to_the_idle_replica_while_the_other_is_busy(proxy, hf, reference):
    proxy, add_worker = proxy
    gate = threading.Event()
    slow, fast = Recording(hf, gate=gate), Recording(hf)
    add_worker(slow)
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=RETRY,
                      max_inflight=4) as client:
        held = client.score_async(_batch([100]))
        assert slow.started.wait(60)
        add_worker(fast)
        # While the slow replica holds request 100, every other request completes on the fast one.
        for tag in (101, 102, 103):
            batch = _batch([tag])
            outputs = client.score(batch)
            reference.assert_matches(outputs[0], batch.sequences[0].token_ids,
                                     batch.sequences[0].response_start, batch.top_k)
        assert not held.done()
        assert (slow.tags, fast.tags) == ([100], [101, 102, 103])
        gate.set()
        held.result(timeout=60)
    assert client.num_retries == 0


def test_split_request_is_scored_by_both_replicas_and_reassembled_in_order(proxy, hf, reference):
    proxy, add_worker = proxy
    barrier = threading.Barrier(2, timeout=60)  # each half waits for the other: scored together
    replicas = [Recording(hf, barrier=barrier), Recording(hf, barrier=barrier)]
    for replica in replicas:
        add_worker(replica)
    batch = _batch([11, 12, 13, 14, 15, 16])
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=RETRY,
                      split_requests=2) as client:
        outputs = client.score(batch)
    assert sorted(tag for replica in replicas for tag in replica.tags) == [11, 15]  # one half each: sequences 0-3 and 4-5
    assert len(outputs) == len(batch.sequences)
    for output, sequence in zip(outputs, batch.sequences, strict=True):
        assert len(output.token_logprobs) == sequence.num_response_tokens
        reference.assert_matches(output, sequence.token_ids, sequence.response_start, batch.top_k)


def test_a_failed_part_fails_the_whole_batch(proxy, hf):
    proxy, add_worker = proxy
    replicas = [Recording(hf), Recording(hf)]
    for replica in replicas:
        add_worker(replica)
    batch = _batch([21, 22, 23, 24, FAIL_TAG, 26])  # the second half (4-5) is refused
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=RETRY,
                      split_requests=2) as client:
        with pytest.raises(TeacherError) as error:
            client.score(batch)
    assert error.value.code == ErrorCode.BAD_REQUEST
    assert 21 in [tag for replica in replicas for tag in replica.tags], "the first half was scored, and dropped"


@pytest.mark.parametrize("lengths, parts, blocks", [
    ([10] * 8, 2, [(0, 4), (4, 8)]),
    ([10] * 8, 3, [(0, 3), (3, 6), (6, 8)]),
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),   # the long sequence alone
    ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
    ([5, 5], 4, [(0, 1), (1, 2)]),           # never an empty block
    ([7], 3, [(0, 1)]),
])
def test_split_sequences_is_contiguous_balanced_and_never_empty(lengths, parts, blocks):
    assert [(block.start, block.stop) for block in split_sequences(lengths, parts)] == blocks
