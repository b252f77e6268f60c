"""The teacher's distribution is softmax(logits / T) in every backend and signal.

hf here, against the model's own logits in float64 (:class:`ReferenceTeacher`); the megatron backend and
the local client are pinned the same way at T = 0.5, 1 and 2 for both signals in
tests/distributed/teacher/test_megatron_teacher.py. vLLM serves T = 1 only and refuses any other T with
the fix, before any engine work (worker and backend); the config refuses it before a run starts
(tests/unit/config/test_temperature_checks.py).
"""

import dataclasses

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.backends import BackendInfo, TeacherBackend, build_backend
from megatron_gkd.teacher.backends.vllm import VLLMBackend
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher
from tests.unit.teacher.conftest import LIMITS, SECRET, random_sequences

VOCAB = 512
FIX = "set teacher.temperature=1.0, or serve this teacher with the hf or megatron backend"


@pytest.fixture(scope="module")
def hf(teacher_dir):
    return build_backend("hf", model=str(teacher_dir))


@pytest.fixture(scope="module")
def reference(teacher_dir):
    return ReferenceTeacher(teacher_dir)


def _batch(temperature: float, signal: str = "topk") -> ScoreBatch:
    return ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start)
                                 for ids, start in random_sequences(4, VOCAB, seed=int(temperature * 10))],
                      top_k=32, temperature=temperature, signal=signal, hidden_dtype="float32")


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_hf_topk_is_softmax_of_logits_over_t(hf, reference, temperature):
    batch = _batch(temperature)
    for output, sequence in zip(hf.score(batch), batch.sequences, strict=True):
        # float64 [T, V]; atol as ReferenceTeacher.assert_matches (the backend runs in float32)
        want = reference.logprobs(sequence.token_ids, sequence.response_start, temperature)
        rows = np.arange(len(want))[:, None]
        np.testing.assert_allclose(output.topk_logprobs, want[rows, output.topk_ids], rtol=0, atol=1e-4)
        np.testing.assert_allclose(output.token_logprobs, want[rows[:, 0], sequence.response_ids], rtol=0, atol=1e-4)
        # And not the T = 1 distribution: the test would pass a backend that ignores T otherwise.
        plain = reference.logprobs(sequence.token_ids, sequence.response_start, 1.0)
        assert np.abs(output.token_logprobs - plain[rows[:, 0], sequence.response_ids]).max() > 1e-2


def test_hf_hidden_token_logprobs_are_at_t(hf, reference):
    """The hidden signal's token log-probs carry T; its hidden states have none (the trainer divides the
    logits it recomputes by teacher.temperature)."""
    hidden = _batch(2.0, signal="hidden")
    topk = dataclasses.replace(hidden, signal="topk")
    for got, plain, sequence in zip(hf.score(hidden), hf.score(dataclasses.replace(hidden, temperature=1.0)),
                                    hidden.sequences, strict=True):
        want = reference.logprobs(sequence.token_ids, sequence.response_start, 2.0)
        np.testing.assert_allclose(got.token_logprobs, want[np.arange(len(want)), sequence.response_ids],
                                   rtol=0, atol=1e-4)
        np.testing.assert_array_equal(got.hidden, plain.hidden)  # no temperature in the hidden states
    for got, want in zip(hf.score(hidden), hf.score(topk), strict=True):
        np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, rtol=0, atol=1e-6)


class _TemperatureOneOnly(TeacherBackend):
    """What the vllm backend tells the worker about itself; scoring must never be reached."""

    def __init__(self, hf):
        self._info = dataclasses.replace(hf.info(), name="vllm", supports_temperature=False,
                                         supports_requested_ids=False, hidden_size=None, signals=["topk"])

    def info(self) -> BackendInfo:
        return self._info

    def score(self, batch):
        raise AssertionError("the worker must refuse T != 1 before the backend scores")


def test_a_temperature_one_teacher_refuses_another_t_naming_the_fix(hf):
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    worker = Worker(proxy.backend_address, _TemperatureOneOnly(hf), secret=SECRET, limits=LIMITS).start()
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET,
                          retry=RetryPolicy(attempt_timeout_s=30, deadline_s=60)) as client:
            with pytest.raises(TeacherError) as error:
                client.score(_batch(2.0))
    finally:
        worker.close()
        proxy.close()
    assert error.value.code == ErrorCode.UNSUPPORTED
    assert "the vllm backend scores at temperature 1.0 only, got 2.0" in str(error.value) and FIX in str(error.value)


def test_vllm_backend_refuses_another_t_before_using_its_engine(hf):
    # Built without an engine (vLLM takes minutes to start here): the refusal comes before any engine call.
    backend = VLLMBackend.__new__(VLLMBackend)
    backend._info = _TemperatureOneOnly(hf).info()
    with pytest.raises(TeacherError) as error:
        backend.score(_batch(0.5))
    assert error.value.code == ErrorCode.UNSUPPORTED and "got 0.5" in str(error.value) and FIX in str(error.value)
