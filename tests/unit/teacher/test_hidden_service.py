"""The hidden signal end to end: the hf backend against transformers, through the service, and against
hostile peers (a worker that lies about its answer, requests past the bounds)."""


import msgpack
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.backends import TeacherBackend, build_backend
from megatron_gkd.teacher.clients import TeacherInfo
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import HIDDEN_DTYPES, ErrorCode
from megatron_gkd.teacher.service.server import Proxy, Worker
from tests.unit.teacher import peers
from tests.unit.teacher.conftest import LIMITS, SECRET, random_sequences

VOCAB, HIDDEN = 512, 128  # the tiny teacher's
QUICK = RetryPolicy(attempt_timeout_s=2, deadline_s=6, max_attempts=2, backoff_s=0.05)


def _batch(seed: int = 0, num: int = 5, hidden_dtype: str = "float32", temperature: float = 0.7) -> ScoreBatch:
    return ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=s)
                                 for ids, s in random_sequences(num, VOCAB, seed=seed)],
                      top_k=4, temperature=temperature, signal="hidden", hidden_dtype=hidden_dtype)


@pytest.fixture(scope="module")
def backend(teacher_dir):
    return build_backend("hf", model=str(teacher_dir))


@pytest.fixture(scope="module")
def reference(teacher_dir):
    """float64 transformers: its last hidden state is the output layer's input, after the final norm."""
    return AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()


@pytest.fixture()
def client(service):
    proxy, _ = service
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET,
                      retry=RetryPolicy(attempt_timeout_s=30, deadline_s=60)) as client:
        yield client


def test_hf_hidden_is_the_output_layer_input_and_gives_the_token_logprobs(backend, reference):
    info = backend.info()
    assert info.hidden_size == HIDDEN and info.signals == ["topk", "hidden"]
    batch = _batch()
    head = reference.get_output_embeddings().weight.detach()  # [V, h]
    for output, sequence in zip(backend.score(batch), batch.sequences, strict=True):
        output.validate(sequence.num_response_tokens, batch.top_k, sequence=sequence, hidden_size=HIDDEN)
        start = sequence.response_start
        with torch.no_grad():
            states = reference(input_ids=torch.as_tensor(sequence.token_ids)[None],
                               output_hidden_states=True).hidden_states[-1][0]
        # Every row: row 0 (the prompt's last position) through the last response token.
        np.testing.assert_allclose(output.hidden, states[start - 1:-1].numpy(), rtol=0, atol=1e-4)
        logits = torch.from_numpy(output.hidden).double() @ head.T / batch.temperature
        logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(output.hidden)), sequence.response_ids]
        np.testing.assert_allclose(output.token_logprobs, logprobs.numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("hidden_dtype", HIDDEN_DTYPES)
def test_hidden_through_the_service_is_the_backends_rounded_to_the_wire_dtype(client, backend, hidden_dtype):
    batch = _batch(seed=3, hidden_dtype=hidden_dtype)
    direct = backend.score(batch)
    for got, want in zip(client.score(batch), direct, strict=True):
        rounded = torch.from_numpy(want.hidden).to(getattr(torch, hidden_dtype)).float().numpy()
        np.testing.assert_array_equal(got.hidden, rounded)
        np.testing.assert_array_equal(got.token_logprobs, want.token_logprobs)
        assert got.topk_ids.shape == (len(want.hidden), 0)


def test_a_top_k_batch_still_gets_the_top_k(client):
    batch = ScoreBatch(sequences=_batch().sequences, top_k=8)
    assert all(o.hidden is None and o.topk_ids.shape[1] == 8 for o in client.score(batch))


class TopKOnly(TeacherBackend):
    """The hf backend, telling clients it serves the top-k signal only (as vllm does)."""

    def __init__(self, inner):
        self.inner, self.scored = inner, 0

    def info(self):
        info = self.inner.info()
        return type(info)(**{**info.to_dict(), "hidden_size": None, "signals": ["topk"]})

    def score(self, batch):
        self.scored += 1
        return self.inner.score(batch)


def test_a_teacher_without_hidden_states_is_refused_with_the_fix(backend):
    top_k_only = TopKOnly(backend)
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    worker = Worker(proxy.backend_address, top_k_only, secret=SECRET, limits=LIMITS).start()
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=QUICK) as client:
            with pytest.raises(ValueError, match="not 'hidden'.*teacher.serve.backend=hf or megatron"):
                client.score(_batch())  # refused by the client, from the teacher's INFO
            assert worker.num_answered == 1  # the INFO only
            # A client that skips the check (or an old INFO) is refused by the worker, before compute.
            facts = backend.info().to_dict()
            client._info = TeacherInfo(**{key: facts[key] for key in TeacherInfo.__dataclass_fields__})
            with pytest.raises(TeacherError, match="use the hf or megatron backend") as info:
                client.score(_batch())
            assert info.value.code == ErrorCode.UNSUPPORTED and top_k_only.scored == 0
    finally:
        worker.close()
        proxy.close()


def test_an_oversized_hidden_result_is_refused_before_compute(service, backend):
    proxy, worker = service
    # 4 x 199 rows of 128 float32 values: 410 KB, over the service's 256 KiB; in bf16 205 KB fit.
    sequences = [SequenceRequest(token_ids=np.arange(3, 203) % VOCAB, response_start=1)] * 4
    big = ScoreBatch(sequences=sequences, top_k=4, signal="hidden", hidden_dtype="float32")
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS) as client:
        with pytest.raises(ValueError, match="h=128 in float32.*smaller batches"):
            client.score(big)  # the client knows, before sending
    roomy = wire.Limits(max_message_bytes=2**26)
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=roomy, retry=QUICK) as client:
        answered = worker.num_answered
        with pytest.raises(TeacherError, match="bytes, over the limit") as info:
            client.score(big)
        assert info.value.code == ErrorCode.TOO_LARGE
        assert len(client.score(ScoreBatch(sequences=sequences, top_k=4, signal="hidden"))) == 4  # bf16 fits
    assert worker.num_answered == answered + 3  # INFO, the refusal, the bf16 answer


def _lying_result(case: str, request_id: str, batch: ScoreBatch, outputs) -> list[bytes]:
    """A signed RESULT for ``batch`` broken as ``case`` says."""
    frames = codec.encode_result(request_id, outputs, SECRET, batch.hidden_dtype)
    if case == "oversized":
        # Past the client's 256 KiB: its socket drops the message (MAXMSGSIZE) and the attempt times out.
        return codec.encode_result(request_id, outputs * 1200, SECRET, batch.hidden_dtype)
    message = wire.decode(frames, LIMITS, SECRET)
    tensors = dict(message.tensors)
    hidden = tensors["hidden"].copy()
    if case == "nan":
        hidden[1, 5] = 0x7FC0  # bfloat16 NaN
        tensors["hidden"] = hidden
    elif case == "bad_dtype":
        tensors["hidden"] = wire.bfloat16_bits_to_float32(hidden)
    elif case == "other_h":
        tensors["hidden"] = hidden[:, :-1].copy()
    elif case == "top_k_kind":
        del tensors["hidden"]
        tensors["topk_ids"] = np.zeros((len(hidden), 4), np.int32)
        tensors["topk_logprobs"] = np.full((len(hidden), 4), -1.5, np.float32)
    frames = wire.encode(wire.RESULT, request_id, {}, tensors, SECRET)
    if case == "shape_lie":  # the header claims a wider h than the bytes that follow
        header = msgpack.unpackb(frames[1])
        spec = next(t for t in header["tensors"] if t["name"] == "hidden")
        spec["shape"][1] += 1
        spec["nbytes"] += 2 * spec["shape"][0]
        frames = [frames[0], msgpack.packb(header), *frames[2:]]
        frames[0] = wire._mac(SECRET, frames[1:])
    return frames


@pytest.mark.parametrize("case, code, match", [
    ("nan", ErrorCode.BAD_OUTPUT, "non-finite"),
    ("bad_dtype", ErrorCode.BAD_OUTPUT, "came as float32, bfloat16 was requested"),
    ("other_h", ErrorCode.BAD_OUTPUT, r"expected \(\d+, 128\)"),
    ("top_k_kind", ErrorCode.BAD_OUTPUT, "the hidden signal was requested"),
    ("shape_lie", ErrorCode.BAD_FRAME, "needs .* bytes"),
    ("oversized", ErrorCode.UNAVAILABLE, "no usable answer"),
])
def test_a_lying_teacher_is_refused_by_the_client(backend, case, code, match):
    """A worker holding the secret answers INFO truthfully and every SCORE with a broken result."""
    batch = _batch(seed=7, num=2, hidden_dtype="bfloat16")
    outputs = backend.score(batch)

    def answer(frames):
        request = wire.decode(frames, LIMITS, SECRET)
        if request.type == wire.INFO:
            return wire.encode(wire.INFO_RESULT, request.request_id, backend.info().to_dict(), secret=SECRET)
        return _lying_result(case, request.request_id, batch, outputs)

    # The proxy forwards a registered worker's reply as it is; its own limit is roomy, so that the
    # oversized result reaches the client, whose 256 KiB limit drops it.
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET,
                  limits=wire.Limits(max_message_bytes=2**26)).start()
    liar = peers.FakeWorker(proxy.backend_address, SECRET, answer, info=backend.info().to_dict())
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS,
                          retry=QUICK) as client:
            with pytest.raises(TeacherError, match=match) as info:
                client.score(batch)
    finally:
        liar.close()
        proxy.close()
    assert info.value.code == code
