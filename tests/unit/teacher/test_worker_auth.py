"""Workers authenticate to the proxy; clients never trust a reply that fails authentication."""

import os
import stat
import threading
import time

import numpy as np
import pytest
import zmq

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher
from tests.unit.teacher import peers
from tests.unit.teacher.conftest import LIMITS, SECRET

RETRY = RetryPolicy(attempt_timeout_s=5, deadline_s=60, max_attempts=10, backoff_s=0.05)


def _batch(seed: int) -> ScoreBatch:
    rng = np.random.default_rng(seed)
    return ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(3, 512, 12), response_start=4)],
                      top_k=4)


class Impersonator:
    """A DEALER on the proxy's worker address that records what it receives and may answer it."""

    def __init__(self, address: str, answer=None):
        self.received = []
        self._answer, self._stop = answer, threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self._socket.poll(20):
                frames = self._socket.recv_multipart()
                self.received.append(frames)
                if self._answer is not None:
                    reply = self._answer(frames)
                    if reply is not None:
                        self._socket.send_multipart(reply)
        self._socket.close()

    def close(self):
        self._stop.set()
        self._thread.join()


def _requests(received) -> list:
    """The client requests among the frames an impersonator received (anything carrying a score)."""
    return [frames for frames in received if any(b"score" in bytes(f) for f in frames)]


def _forged_refusal(frames):
    """Answers with the unsigned bad_signature refusal a worker sends to a stranger."""
    split = frames.index(b"") + 1
    return frames[:split] + wire.error_frames(wire.peek_request_id(frames[split:]) or "x",
                                              ErrorCode.BAD_SIGNATURE, "forged", None)


@pytest.mark.parametrize("answer", [None, _forged_refusal], ids=["silent", "forging_refusals"])
def test_an_impersonated_worker_gets_no_requests_and_cannot_fail_the_client(service, teacher_dir, answer):
    proxy, _ = service
    impostor = Impersonator(proxy.backend_address, answer)
    time.sleep(0.5)  # connected well before the requests
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=RETRY) as client:
            outputs = [client.score(_batch(seed))[0] for seed in range(6)]
    finally:
        impostor.close()
    assert not _requests(impostor.received), "an unauthenticated peer on the worker address got requests"
    reference = ReferenceTeacher(teacher_dir)
    for seed, output in enumerate(outputs):
        sequence = _batch(seed).sequences[0]
        reference.assert_matches(output, sequence.token_ids, sequence.response_start, 4)


def test_a_worker_with_the_wrong_secret_is_refused_at_registration(teacher_dir):
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    backend = build_backend("hf", model=str(teacher_dir))
    wrong = Worker(proxy.backend_address, backend, secret=b"another-secret-of-16+bytes", limits=LIMITS).start()
    time.sleep(0.5)
    right = Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS).start()
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=RETRY) as client:
            for seed in range(4):
                assert client.score(_batch(seed))
    finally:
        for part in (wrong, right, proxy):
            part.close()
    assert wrong.num_answered == 0 and right.num_answered >= 4


def test_the_client_retries_past_replies_that_fail_authentication(teacher_dir):
    """A worker answers the first attempt with a forged refusal, the second with a result signed with
    another key, the third with the truth: the client retries past both forgeries."""
    batch = _batch(0)
    outputs = build_backend("hf", model=str(teacher_dir)).score(batch)
    attempts = []

    def answer(frames):
        request_id = wire.peek_request_id(frames)
        attempts.append(request_id)
        if len(attempts) == 1:
            return wire.error_frames(request_id, ErrorCode.BAD_SIGNATURE, "forged", None)
        if len(attempts) == 2:
            return codec.encode_result(request_id, outputs, b"not-the-secret-at-all")
        return codec.encode_result(request_id, outputs, SECRET)

    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    forger = peers.FakeWorker(proxy.backend_address, SECRET, answer)
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=RETRY) as client:
            got = client.score(batch)
    finally:
        forger.close()
        proxy.close()
    assert len(attempts) == 3
    np.testing.assert_array_equal(got[0].topk_ids, outputs[0].topk_ids)


def test_a_client_with_the_wrong_secret_still_learns_why(service):
    proxy, _ = service
    quick = RetryPolicy(attempt_timeout_s=5, deadline_s=30, max_attempts=3, backoff_s=0.05)
    with build_client("zmq", address=proxy.frontend_address, secret=b"wrong-secret-of-16-bytes",
                      retry=quick) as client:
        with pytest.raises(Exception) as info:
            client.info()
    assert info.value.code == ErrorCode.BAD_SIGNATURE and "secret" in str(info.value)


def test_the_worker_address_defaults_to_a_private_ipc_socket():
    proxy = Proxy("tcp://127.0.0.1:0").start()
    try:
        assert proxy.backend_address.startswith("ipc://")
        directory = os.path.dirname(proxy.backend_address[len("ipc://"):])
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    finally:
        proxy.close()
    assert not os.path.exists(directory)
