"""A busy teacher: a proven client's message over the pending budget is answered "busy", not cut off,
and a client told "busy" waits longer instead of spending its attempts."""

import threading
import time

import numpy as np

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from tests.unit.teacher import peers
from tests.unit.teacher.conftest import LIMITS, SECRET


def _request(request_id: str, num_tokens: int) -> list[bytes]:
    """A signed SCORE of about ``4 * num_tokens`` bytes on the wire."""
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=np.arange(num_tokens) % 500 + 3,
                                                  response_start=num_tokens - 1)], top_k=2)
    return codec.encode_request(request_id, batch, SECRET)


def test_a_signed_message_over_the_budget_is_answered_busy_and_its_connection_kept(teacher_dir):
    # No worker yet: the first request stays queued and holds 160 KB of the 256 KB budget, so the
    # second one crosses it while it streams in.
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS,
                  max_pending_bytes=256 * 2**10).start()
    first, second = peers.proven_dealer(proxy.frontend_address, SECRET), peers.proven_dealer(
        proxy.frontend_address, SECRET)
    worker = None
    try:
        requests = [_request(request_id, 40_000) for request_id in ("first", "second")]
        assert all(150_000 < sum(map(len, frames)) < LIMITS.max_message_bytes for frames in requests)
        first.send_multipart([b"", *requests[0]])
        time.sleep(0.5)  # queued
        second.send_multipart([b"", *requests[1]])
        assert second.poll(10_000), "the message over the budget got no answer"
        reply = wire.decode(second.recv_multipart()[1:], LIMITS, SECRET, expect=(wire.ERROR,))
        assert reply.request_id == "second" and ErrorCode(reply.meta["code"]) == ErrorCode.UNAVAILABLE
        assert "busy" in reply.meta["message"]
        # The connection stays open and usable: both clients are answered once a worker comes.
        second.send_multipart([b"", *wire.encode(wire.INFO, "again", secret=SECRET)])
        worker = Worker(proxy.backend_address, build_backend("hf", model=str(teacher_dir)), secret=SECRET,
                        limits=LIMITS).start()
        # (The worker refuses the first one, longer than the tiny teacher's context, with a signed error.)
        for sock, request_id, kind in ((first, "first", wire.ERROR), (second, "again", wire.INFO_RESULT)):
            assert sock.poll(30_000), f"{request_id} was not answered"
            answer = wire.decode(sock.recv_multipart()[1:], LIMITS, SECRET)
            assert (answer.request_id, answer.type) == (request_id, kind)
    finally:
        first.close()
        second.close()
        if worker is not None:
            worker.close()
        proxy.close()


def test_busy_answers_do_not_spend_the_attempts(teacher_dir):
    # One request may wait and no worker is there for 2 s: the second client is told "busy" at once,
    # again and again. Five attempts with pauses from 0.1 s would be spent in 1.5 s; busy answers
    # must instead only lengthen the pauses, up to the deadline.
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS,
                  max_queued_requests=1).start()
    policy = RetryPolicy(attempt_timeout_s=20, deadline_s=40, max_attempts=5, backoff_s=0.1, backoff_max_s=1.0)
    holder = peers.proven_dealer(proxy.frontend_address, SECRET)
    holder.send_multipart([b"", *wire.encode(wire.INFO, "holder", secret=SECRET)])  # fills the queue
    time.sleep(0.5)

    def start_worker_later():
        time.sleep(2.0)
        workers.append(Worker(proxy.backend_address, build_backend("hf", model=str(teacher_dir)),
                              secret=SECRET, limits=LIMITS).start())

    workers: list = []
    thread = threading.Thread(target=start_worker_later)
    thread.start()
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=policy) as client:
            info = client.info()
            assert client.num_retries >= 5  # told "busy" more times than it had attempts
        assert info.vocab_size > 0
    finally:
        thread.join()
        holder.close()
        for worker in workers:
            worker.close()
        proxy.close()
