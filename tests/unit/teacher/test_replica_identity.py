"""Replicas behind one proxy serve one teacher: a worker of another model is refused at registration."""

import dataclasses
import logging
import shutil
import time

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.backends import TeacherBackend, build_backend
from megatron_gkd.teacher.clients import TeacherInfo
from megatron_gkd.teacher.protocol import identity
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.tiny_teacher import build_tiny_teacher
from tests.unit.teacher.conftest import LIMITS, SECRET

NUM_BATCHES = 20


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    """The unit tests' tiny teacher's shape and tokenizer, other weights (another seed)."""
    return build_tiny_teacher(tmp_path_factory.mktemp("other_teacher"), seed=1)


def test_the_fingerprint_tells_checkpoints_apart_and_ignores_where_they_lie(teacher_dir, other_teacher, tmp_path):
    fingerprint = identity.checkpoint_fingerprint(teacher_dir)
    copy = shutil.copytree(teacher_dir, tmp_path / "elsewhere")
    assert identity.checkpoint_fingerprint(copy) == fingerprint
    assert identity.checkpoint_fingerprint(other_teacher) != fingerprint
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last block is always read
    weights.write_bytes(bytes(data))
    assert identity.checkpoint_fingerprint(copy) != fingerprint
    assert identity.checkpoint_fingerprint(tmp_path / "no-such-directory") is None


def test_a_replica_of_another_model_is_refused_and_answers_nothing(teacher_dir, other_teacher, caplog):
    caplog.set_level(logging.INFO, logger="megatron_gkd.teacher")
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    first = Worker(proxy.backend_address, build_backend("hf", model=str(teacher_dir)), secret=SECRET,
                   limits=LIMITS).start()
    other = same = None
    try:
        _wait_for(lambda: proxy.num_workers == 1)
        other = Worker(proxy.backend_address, build_backend("hf", model=str(other_teacher)), secret=SECRET,
                       limits=LIMITS).start()
        # A replica of the same model is still welcome beside it.
        same = Worker(proxy.backend_address, build_backend("hf", model=str(teacher_dir)), secret=SECRET,
                      limits=LIMITS).start()
        _wait_for(lambda: proxy.num_workers == 2)
        rng = np.random.default_rng(0)
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS,
                          retry=RetryPolicy(attempt_timeout_s=10, deadline_s=30), split_requests=2) as client:
            for _ in range(NUM_BATCHES):
                batch = ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(3, 500, 12), response_start=4)
                                              for _ in range(2)], top_k=4)
                client.score(batch)
        assert other.num_answered == 0, f"the other model's replica answered {other.num_answered} requests"
        assert other.refused and "model_digest" in other.refused  # and it stopped, saying why
        assert first.num_answered + same.num_answered == 2 * NUM_BATCHES and same.num_answered > 0
    finally:
        for worker in (same, other, first):
            if worker is not None:
                worker.close()
        proxy.close()
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage() and "model_digest" in r.getMessage()]
    assert refused, "the refusal does not say which field differs"


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)
    time.sleep(0.5)  # and a little longer, for a registration that should not happen


class ChangingInfo(TeacherBackend):
    """The hf backend, whose INFO changes after it registered when ``changed`` is set (a worker that lies, or a
    bug): the client bounds the ids it accepts by the INFO it is answered."""

    def __init__(self, inner):
        self.inner, self.changed = inner, False

    def info(self):
        info = self.inner.info()
        return dataclasses.replace(info, tokenizer_size=10**9) if self.changed else info

    def score(self, batch):
        return self.inner.score(batch)


def test_an_info_that_differs_from_the_registered_one_never_reaches_the_client(teacher_dir, caplog):
    """Issue #48: the proxy forwarded whatever INFO a worker answered, unchecked against its registration."""
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    backend = ChangingInfo(build_backend("hf", model=str(teacher_dir)))
    worker = Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS).start()
    quick = RetryPolicy(attempt_timeout_s=5, deadline_s=8, max_attempts=2, backoff_s=0.05)
    try:
        _wait_for(lambda: proxy.num_workers == 1)
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS, retry=quick) as client:
            assert client.info().tokenizer_size == backend.inner.info().tokenizer_size
            backend.changed = True
            with pytest.raises(TeacherError, match=r"tokenizer_size: 512 -> 1000000000") as caught:
                client.info()
        assert caught.value.code == ErrorCode.BAD_OUTPUT
        _wait_for(lambda: proxy.num_workers == 0)  # and that worker is cut off
    finally:
        worker.close()
        proxy.close()


@pytest.mark.parametrize("field, value", [("tokenizer_size", "512"), ("tokenizer_size", True),
                                          ("supports_generate", "yes"), ("supports_generate", 1),
                                          ("vocab_size", 0), ("max_top_k", 2.5), ("supports_temperature", None)])
def test_info_fields_of_the_wrong_type_are_named(teacher_dir, field, value):
    info = {**build_backend("hf", model=str(teacher_dir)).info().to_dict(), field: value}
    assert any(problem.startswith(f"{field}=") for problem in identity.info_problems(info))
    fields = {name: info[name] for name in TeacherInfo.__dataclass_fields__}
    with pytest.raises(ValueError, match=rf"^{field}={value!r} must be "):
        TeacherInfo(**fields)


def test_a_worker_registering_a_malformed_info_is_refused(teacher_dir):
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    backend = ChangingInfo(build_backend("hf", model=str(teacher_dir)))
    backend.info = lambda: dataclasses.replace(backend.inner.info(), supports_generate="yes")
    worker = Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS).start()
    try:
        _wait_for(lambda: worker.refused is not None)
        assert "supports_generate='yes' must be a bool" in worker.refused
        assert proxy.num_workers == 0
    finally:
        worker.close()
        proxy.close()
