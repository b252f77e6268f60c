"""Replicas behind one proxy serve one teacher: a worker of another model is refused at registration."""

import logging
import shutil
import time

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client, identity
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.server import Proxy, Worker
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
