"""The work one request may cause is bounded before any compute, with typed errors."""

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.backends import TeacherBackend, build_backend
from megatron_gkd.teacher.protocol import wire
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from tests.unit.teacher.conftest import SECRET

LIMITS = wire.Limits(max_message_bytes=16 * 2**20)
CONTEXT = 1024  # the tiny teacher's max_position_embeddings
MAX_BATCH_TOKENS = 256


class CountingBackend(TeacherBackend):
    """The hf backend, counting the forward passes it runs (and failing big batches, to stay quick)."""

    def __init__(self, inner):
        self.inner, self.forwards = inner, 0
        forward = inner._model.forward

        def counted(*args, **kwargs):
            self.forwards += 1
            return forward(*args, **kwargs)

        inner._model.forward = counted

    def info(self):
        return self.inner.info()

    def score(self, batch):
        if sum(len(s.token_ids) for s in batch.sequences) > 4096:
            raise RuntimeError("this test never means a batch this large to be computed")
        return self.inner.score(batch)


@pytest.fixture(scope="module")
def bounded(teacher_dir):
    backend = CountingBackend(build_backend("hf", model=str(teacher_dir), max_batch_tokens=MAX_BATCH_TOKENS))
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    worker = Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS).start()
    retry = RetryPolicy(attempt_timeout_s=60, deadline_s=120, max_attempts=2, backoff_s=0.05)
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS, retry=retry) as client:
        yield client, backend
    worker.close()
    proxy.close()


def _sequences(count: int, length: int, response: int = 1):
    rng = np.random.default_rng(length)
    return [SequenceRequest(token_ids=rng.integers(3, 512, length), response_start=length - response)
            for _ in range(count)]


@pytest.mark.parametrize("case, code, match", [
    ("longer_than_context", ErrorCode.BAD_REQUEST, "context"),
    ("longer_than_max_batch_tokens", ErrorCode.TOO_LARGE, "max_batch_tokens"),
    ("too_many_tokens", ErrorCode.TOO_LARGE, "tokens"),
    ("reply_too_large", ErrorCode.TOO_LARGE, "bytes"),
])
def test_oversized_work_is_refused_before_compute(bounded, case, code, match):
    client, backend = bounded
    if case == "longer_than_context":
        batch = ScoreBatch(sequences=_sequences(1, CONTEXT + 1), top_k=4)
    elif case == "longer_than_max_batch_tokens":  # fits the context, not one forward pass
        batch = ScoreBatch(sequences=_sequences(1, MAX_BATCH_TOKENS + 1), top_k=4)
    elif case == "too_many_tokens":  # every sequence fits, the request as a whole does not
        batch = ScoreBatch(sequences=_sequences(2**21 // 200 + 1, 200), top_k=1)
    else:  # 200 rows x k=512 is ~800 KB: fine; 40 such sequences are 32 MB, over the 16 MB limit
        batch = ScoreBatch(sequences=_sequences(40, 201, response=200), top_k=512)
    forwards = backend.forwards
    client._limits = wire.Limits(max_message_bytes=2**30)  # so the client does not refuse it first
    try:
        with pytest.raises(TeacherError, match=match) as info:
            client.score(batch)
    finally:
        client._limits = LIMITS
    assert info.value.code == code
    assert backend.forwards == forwards, "the backend computed before the request was refused"
    assert client.score(ScoreBatch(sequences=_sequences(1, 20), top_k=4))  # and it still serves
