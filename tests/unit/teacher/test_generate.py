"""Teacher generation over the wire: a served hf teacher samples valid responses (and scores them in
the same request); oversized, forged and unsupported requests are refused before any sampling; a worker
whose responses break the contract is refused by the client with an error naming what is wrong."""

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from megatron_gkd.rollout import sampling as rollout_sampling
from megatron_gkd.teacher import GenerateBatch, GeneratedSample, RetryPolicy, TeacherClient, TeacherError, build_client
from megatron_gkd.teacher.backends import TeacherBackend, build_backend
from megatron_gkd.teacher.protocol import codec, sampling, wire
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service import cli
from megatron_gkd.teacher.service.server import Proxy, Worker, WorkLimits, check_generate_work
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher
from tests.unit.teacher import peers
from tests.unit.teacher.conftest import LIMITS, SECRET

VOCAB = 512
CONTEXT = 1024  # the tiny teacher's max_position_embeddings
QUICK = RetryPolicy(attempt_timeout_s=10, deadline_s=20, max_attempts=2, backoff_s=0.05)


def _prompts(num: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, int(length)) for length in rng.integers(1, 12, num)]


@pytest.fixture()
def client(service):
    proxy, _ = service
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS,
                      retry=RetryPolicy(attempt_timeout_s=30, deadline_s=60)) as client:
        yield client


@pytest.fixture(scope="module")
def hf_backend(teacher_dir):
    return build_backend("hf", model=str(teacher_dir))


# ---- a real served teacher ------------------------------------------------------------------------

def test_served_teacher_generates_valid_scored_responses(client, teacher_dir):
    batch = GenerateBatch(prompts=_prompts(3), num_samples=2, max_tokens=10, stop_ids=(7, 11), seed=3,
                          temperature=1.5, top_p=0.95, top_k=50, score_top_k=8)
    samples = client.generate(batch)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    reference = ReferenceTeacher(teacher_dir)
    for sample in samples:
        ids = sample.response_ids
        assert ids.dtype == np.int64 and 1 <= len(ids) <= 10 and ((ids >= 0) & (ids < VOCAB)).all()
        assert not np.isin(ids[:-1], batch.stop_ids).any()
        assert len(ids) == 10 or ids[-1] in batch.stop_ids
        # The rows scored in the same request are the teacher's own rows of prompt + response.
        prompt = batch.prompts[sample.prompt_index]
        reference.assert_matches(sample.output, np.concatenate([prompt, ids]), len(prompt), 8)
    assert len({s.response_ids.tobytes() for s in samples}) == len(samples)  # samples differ


def test_a_seed_repeats_its_samples_and_another_seed_does_not(client):
    batch = GenerateBatch(prompts=_prompts(2, seed=1), num_samples=3, max_tokens=8, seed=11)
    first, again = client.generate(batch), client.generate(batch)
    other = client.generate(dataclasses.replace(batch, seed=12))
    assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(first, again))
    assert not all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(first, other))


def test_greedy_follows_the_teachers_argmax_and_stops_at_a_stop_id(client):
    prompts = _prompts(2, seed=2)
    greedy = client.generate(GenerateBatch(prompts=prompts, temperature=0, max_tokens=8, score_top_k=1))
    for sample in greedy:
        assert len(sample.response_ids) == 8
        np.testing.assert_array_equal(sample.response_ids, sample.output.topk_ids[:, 0])
    # A stop id ends the response at its first occurrence, which the response keeps.
    stop = int(greedy[0].response_ids[2])
    first = int(np.argmax(greedy[0].response_ids == stop))
    stopped = client.generate(GenerateBatch(prompts=prompts[:1], temperature=0, max_tokens=8, stop_ids=(stop,)))
    np.testing.assert_array_equal(stopped[0].response_ids, greedy[0].response_ids[:first + 1])
    assert stopped[0].finish_reason((stop,)) == "stop" and greedy[0].finish_reason((stop,)) == "length"


def test_samples_do_not_depend_on_how_the_backend_groups_rows(hf_backend, teacher_dir):
    batch = GenerateBatch(prompts=_prompts(4, seed=4), num_samples=2, max_tokens=6, seed=5)
    together = hf_backend.generate(batch)
    one_row_at_a_time = build_backend("hf", model=str(teacher_dir), max_batch_tokens=12 + 6)
    apart = one_row_at_a_time.generate(batch)
    assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(together, apart))


def test_responses_streams_come_from_one_generator_not_one_each(generators_made):
    """Issue #48: a generator a response (2.7 KB each) made one request of 1,024 prompts x 1,024 one-token samples
    hold 2.7 GB before sampling anything."""
    batch = GenerateBatch(prompts=_prompts(8), num_samples=16, max_tokens=3, seed=11)
    expected = torch.stack([torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
                            for seed in sampling.row_seeds(batch)])
    generators_made.clear()  # the expected streams' own
    torch.testing.assert_close(sampling.row_uniforms(batch), expected, rtol=0, atol=0)
    assert len(generators_made) <= 1, f"{len(generators_made)} generators for {batch.num_responses} responses"


def test_sampling_policy_top_k_top_p_and_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -torch.inf]] * 4000)
    uniforms = rollout_sampling.draw_uniforms([torch.Generator().manual_seed(i) for i in range(len(logits))], 1)[:, 0]

    def picks(**params):
        batch = GenerateBatch(prompts=[np.array([1])], **params)
        return torch.bincount(sampling.sample_next(logits, batch, uniforms), minlength=5).numpy() / len(logits)

    np.testing.assert_array_equal(picks(temperature=0), [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(picks(top_k=1), [1, 0, 0, 0, 0])
    assert picks(top_k=2)[2:].sum() == 0
    # p(0) = 0.61 < 0.7 <= p(0) + p(1): the nucleus holds ids 0 and 1, renormalised.
    np.testing.assert_allclose(picks(top_p=0.7)[:2], torch.softmax(logits[0, :2], 0), atol=0.03)
    np.testing.assert_allclose(picks(temperature=2.0), torch.softmax(logits[0] / 2, 0), atol=0.03)
    assert picks()[4] == 0  # -inf (an id past the tokenizer) is never sampled


# ---- bounds ---------------------------------------------------------------------------------------

class CountingBackend(TeacherBackend):
    """The hf backend, counting generate calls; ``can_generate=False`` makes it a scoring-only backend."""

    def __init__(self, inner, can_generate: bool = True):
        self.inner, self.calls, self.can_generate = inner, 0, can_generate

    def info(self):
        info = self.inner.info()
        return info if self.can_generate else dataclasses.replace(info, name="score-only", supports_generate=False)

    def score(self, batch):
        return self.inner.score(batch)

    def generate(self, batch):
        self.calls += 1
        return self.inner.generate(batch) if self.can_generate else super().generate(batch)


@pytest.fixture(scope="module")
def bounded(hf_backend):
    backend = CountingBackend(hf_backend)
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    work = WorkLimits(max_request_tokens=4096, max_generate_prompts=8, max_new_tokens=64, max_generate_bytes=2**20)
    worker = Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS, work=work).start()
    yield proxy, backend
    worker.close()
    proxy.close()


@pytest.mark.parametrize("case, code, match", [
    ("too_many_prompts", ErrorCode.TOO_LARGE, "max_generate_prompts=8"),
    ("too_many_new_tokens", ErrorCode.TOO_LARGE, "max_new_tokens=64"),
    ("too_many_tokens", ErrorCode.TOO_LARGE, "max_request_tokens=4096"),
    ("longer_than_context", ErrorCode.BAD_REQUEST, "context of 1024"),
    ("prompt_outside_vocab", ErrorCode.BAD_REQUEST, "vocabulary of 512"),
    ("reply_too_large", ErrorCode.TOO_LARGE, "bytes"),
    ("score_k_too_large", ErrorCode.UNSUPPORTED, "max"),
    ("too_many_responses", ErrorCode.TOO_LARGE, r"1024 responses of up to 1 tokens\), over this worker's "
                                                r"max_generate_bytes=1048576"),
])
def test_oversized_generate_requests_are_refused_before_sampling(bounded, case, code, match):
    proxy, backend = bounded
    batch = {
        "too_many_prompts": GenerateBatch(prompts=_prompts(9), max_tokens=4),
        "too_many_new_tokens": GenerateBatch(prompts=_prompts(1), max_tokens=65),
        "too_many_tokens": GenerateBatch(prompts=_prompts(8), num_samples=10, max_tokens=64),
        "longer_than_context": GenerateBatch(prompts=[np.full(CONTEXT - 10, 5)], max_tokens=11),
        "prompt_outside_vocab": GenerateBatch(prompts=[np.array([3, VOCAB])], max_tokens=4),
        "reply_too_large": GenerateBatch(prompts=_prompts(2), num_samples=3, max_tokens=60, score_top_k=128),
        "score_k_too_large": GenerateBatch(prompts=_prompts(1), max_tokens=4, score_top_k=VOCAB + 1),
        # 2,048 tokens, within max_request_tokens: a million of such responses held 3.3 GB.
        "too_many_responses": GenerateBatch(prompts=[np.array([5])], num_samples=1024, max_tokens=1),
    }[case]
    calls = backend.calls
    roomy = wire.Limits(max_message_bytes=2**26)  # so that the client does not refuse it first
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=roomy, retry=QUICK) as client:
        with pytest.raises(TeacherError, match=match) as info:
            client.generate(batch)
        assert info.value.code == code
        assert backend.calls == calls  # refused before the backend sampled anything
        assert client.generate(GenerateBatch(prompts=_prompts(1), max_tokens=2))  # the worker still serves


def test_generation_bounds_of_the_command_line_reach_worker_processes():
    args = cli.build_parser().parse_args(["serve", "--model", "m", "--max-generate-prompts", "3",
                                          "--max-new-tokens", "7"])
    worker = cli.build_parser().parse_args(["worker", *cli._worker_args(args)])
    assert (worker.max_generate_prompts, worker.max_new_tokens) == (3, 7)
    args = cli.build_parser().parse_args(["serve", "--model", "m", "--max-generate-mb", "64"])
    assert cli.build_parser().parse_args(["worker", *cli._worker_args(args)]).max_generate_mb == 64


def test_the_default_budget_refuses_the_million_response_request_before_sampling(hf_backend):
    """Issue #48: within every other default bound, 1,024 prompts x 1,024 one-token samples held 3.3 GB."""
    batch = GenerateBatch(prompts=[np.array([5])] * 1024, num_samples=1024, max_tokens=1)
    with pytest.raises(TeacherError, match=r"1048576 responses of up to 1 tokens\), over this worker's "
                                           r"max_generate_bytes=1073741824") as caught:
        check_generate_work(batch, hf_backend.info(), WorkLimits(), wire.Limits())
    assert caught.value.code == ErrorCode.TOO_LARGE
    batch = GenerateBatch(prompts=[np.array([5])] * 1024, num_samples=64, max_tokens=16)
    check_generate_work(batch, hf_backend.info(), WorkLimits(), wire.Limits())  # 65,536 responses: 0.2 GB


def test_client_refuses_a_reply_that_cannot_fit_before_sending(client):
    with pytest.raises(ValueError, match="over the message limit"):
        client.generate(GenerateBatch(prompts=_prompts(8), num_samples=8, max_tokens=64, score_top_k=64))


def test_a_backend_that_cannot_generate_refuses_naming_itself(hf_backend):
    backend = CountingBackend(hf_backend, can_generate=False)
    with pytest.raises(TeacherError, match="score-only teacher backend cannot generate") as info:
        backend.generate(GenerateBatch(prompts=_prompts(1)))
    assert info.value.code == ErrorCode.UNSUPPORTED
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    worker = Worker(proxy.backend_address, backend, secret=SECRET, limits=LIMITS).start()
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, retry=QUICK) as client:
            with pytest.raises(TeacherError, match="cannot generate") as info:  # told by INFO, before sending
                client.generate(GenerateBatch(prompts=_prompts(1)))
        assert info.value.code == ErrorCode.UNSUPPORTED
        # A request sent regardless is refused by the worker, naming the backend.
        reply = _send_raw(proxy, codec.encode_generate_request("g1", GenerateBatch(prompts=_prompts(1)), SECRET))
        assert reply.type == wire.ERROR and reply.meta["code"] == ErrorCode.UNSUPPORTED.value
        assert "score-only" in reply.meta["message"]
    finally:
        worker.close()
        proxy.close()
    assert backend.calls == 1  # the direct call above only


def test_clients_without_generation_refuse_naming_themselves():
    class ScoringOnlyClient(TeacherClient):
        def _score(self, batch):
            raise AssertionError("not called")

        def info(self):
            raise AssertionError("not called")

    with ScoringOnlyClient() as client, pytest.raises(TeacherError, match="ScoringOnlyClient .* cannot") as info:
        client.generate(GenerateBatch(prompts=_prompts(1)))
    assert info.value.code == ErrorCode.UNSUPPORTED


# ---- authentication -------------------------------------------------------------------------------

def _send_raw(proxy, frames: list[bytes], secret: bytes | None = SECRET) -> wire.Message:
    """Sends ``frames`` as a proven client and returns the reply (signed, or unsigned when ``secret`` is None)."""
    sock = peers.proven_dealer(proxy.frontend_address, SECRET)
    try:
        sock.send_multipart([b"", *frames])
        assert sock.poll(20_000), "no reply"
        return wire.decode(sock.recv_multipart()[1:], LIMITS, secret, expect=(wire.ERROR, wire.GENERATED))
    finally:
        sock.close()


@pytest.mark.parametrize("case", ["unsigned", "wrong_secret", "tampered_after_signing"])
def test_unsigned_or_forged_generate_requests_are_refused(bounded, case):
    proxy, backend = bounded
    batch = GenerateBatch(prompts=_prompts(1), max_tokens=4)
    if case == "unsigned":
        frames = codec.encode_generate_request("forged", batch, None)
    elif case == "wrong_secret":
        frames = codec.encode_generate_request("forged", batch, b"not-the-secret-at-all")
    else:  # a signed request whose max_tokens is raised on the way
        frames = codec.encode_generate_request("forged", batch, SECRET)
        header = msgpack.unpackb(frames[1])
        header["meta"]["max_tokens"] = 64
        frames = [frames[0], msgpack.packb(header), *frames[2:]]
    calls = backend.calls
    reply = _send_raw(proxy, frames, secret=None)  # a refusal to an unauthenticated sender is unsigned
    assert reply.type == wire.ERROR and reply.meta["code"] == ErrorCode.BAD_SIGNATURE.value
    assert reply.request_id == wire.UNAUTHENTICATED_ID  # it does not name the forged request
    assert backend.calls == calls
    with build_client("zmq", address=proxy.frontend_address, secret=b"not-the-secret-at-all",
                      retry=QUICK) as wrong:
        with pytest.raises(TeacherError) as info:
            wrong.generate(batch)
    assert info.value.code == ErrorCode.BAD_SIGNATURE


# ---- a worker that lies ---------------------------------------------------------------------------

_LIES = {
    "id_outside_vocab": "id 512, outside the teacher's vocabulary of 512 ids",
    "negative_id": "id -3, outside the teacher's vocabulary",
    "too_long": "a response has 1..max_tokens=6",
    "empty": "a response has 1..max_tokens=6",
    "missing_response": "expected 4",
    "goes_on_after_stop": "goes on after stop id 9",
    "short_without_stop": "without a stop id, short of max_tokens=6",
    "missing_rows": "reply tensors",
    "rows_of_another_response": "token_logprobs row",
}


def _lie(case: str, request: wire.Message, truth: list[GeneratedSample]) -> list[bytes]:
    samples = [dataclasses.replace(s) for s in truth]
    ids = samples[1].response_ids = np.full(6, 20, np.int64)  # a full-length response to edit
    if case == "id_outside_vocab":
        ids[2] = VOCAB
    elif case == "negative_id":
        ids[4] = -3
    elif case == "too_long":
        samples[1].response_ids = np.full(7, 20, np.int64)
    elif case == "empty":
        samples[1].response_ids = np.zeros(0, np.int64)
    elif case == "missing_response":
        samples = samples[:-1]
    elif case == "goes_on_after_stop":
        ids[3] = 9
    elif case == "short_without_stop":
        samples[1].response_ids = ids[:3]
    elif case == "rows_of_another_response":
        samples[0], samples[1] = dataclasses.replace(samples[0], output=truth[1].output), \
            dataclasses.replace(samples[1], response_ids=truth[1].response_ids, output=truth[0].output)
    if case != "rows_of_another_response":  # rows that fit the (edited) response, so only the lie shows
        for sample in samples:
            rows = len(sample.response_ids)
            sample.output = dataclasses.replace(truth[0].output, topk_ids=np.tile(np.arange(4), (rows, 1)),
                                                topk_logprobs=np.tile(np.float32([-1, -2, -3, -4]), (rows, 1)),
                                                token_logprobs=np.full(rows, -50.0, np.float32))
    frames = codec.encode_generated(request.request_id, samples, SECRET)
    if case == "missing_rows":
        message = wire.decode(frames, LIMITS, SECRET)
        tensors = {k: v for k, v in message.tensors.items() if k in ("response_lengths", "response_ids")}
        frames = wire.encode(wire.GENERATED, request.request_id, {}, tensors, SECRET)
    return frames


@pytest.mark.parametrize("case", sorted(_LIES))
def test_a_worker_whose_responses_break_the_contract_is_refused_by_the_client(hf_backend, case):
    """A worker holding the secret answers INFO truthfully and every GENERATE with a broken reply."""
    batch = GenerateBatch(prompts=_prompts(2, seed=8), num_samples=2, max_tokens=6, stop_ids=(9,), seed=1,
                          score_top_k=4)
    truth = hf_backend.generate(dataclasses.replace(batch, stop_ids=()))
    truth = [dataclasses.replace(s, output=o) for s, o in zip(truth, hf_backend.score(batch.score_batch(truth)))]

    def answer(frames):
        request = wire.decode(frames, LIMITS, SECRET)
        if request.type == wire.INFO:
            return wire.encode(wire.INFO_RESULT, request.request_id, hf_backend.info().to_dict(), secret=SECRET)
        return _lie(case, request, truth)

    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    liar = peers.FakeWorker(proxy.backend_address, SECRET, answer, info=hf_backend.info().to_dict())
    try:
        with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS,
                          retry=QUICK) as client:
            with pytest.raises(TeacherError, match=_LIES[case]) as info:
                client.generate(batch)
    finally:
        liar.close()
        proxy.close()
    assert info.value.code == ErrorCode.BAD_OUTPUT


# ---- the request schema ---------------------------------------------------------------------------

def test_generate_request_round_trips():
    batch = GenerateBatch(prompts=_prompts(3), num_samples=2, temperature=0.7, top_p=0.9, top_k=5,
                          max_tokens=33, stop_ids=(2, 9), seed=2**40, score_top_k=16, score_temperature=2.0)
    decoded = codec.decode_generate_request(wire.decode(codec.encode_generate_request("r", batch, SECRET),
                                                        LIMITS, SECRET))
    for field in dataclasses.fields(GenerateBatch):
        if field.name != "prompts":
            assert getattr(decoded, field.name) == getattr(batch, field.name), field.name
    assert all(np.array_equal(a, b) for a, b in zip(decoded.prompts, batch.prompts))


@pytest.mark.parametrize("change, match", [
    (lambda meta, tensors: meta.update(num_samples=True), "num_samples"),
    (lambda meta, tensors: meta.update(top_p=1.5), "top_p"),
    (lambda meta, tensors: meta.update(temperature=-1.0), "temperature"),
    (lambda meta, tensors: meta.update(score_top_k=0), "score_top_k"),
    (lambda meta, tensors: meta.update(extra=1), "meta keys"),
    (lambda meta, tensors: tensors.update(prompt_lengths=np.array([2, 2], np.int64)), "sum to"),
    (lambda meta, tensors: tensors.update(prompt_ids=np.array([1, -1, 3], np.int32)), ">= 0"),
    (lambda meta, tensors: tensors.update(stop_ids=np.arange(65, dtype=np.int32)), "stop ids"),
    (lambda meta, tensors: tensors.update(prompt_ids=np.array([1, 2, 3], np.int64)), "int32"),
])
def test_malformed_generate_requests_are_bad_requests(change, match):
    good = wire.decode(codec.encode_generate_request("r", GenerateBatch(prompts=[np.array([1, 2, 3])]), None),
                       LIMITS)
    meta, tensors = dict(good.meta), dict(good.tensors)
    change(meta, tensors)
    message = wire.decode(wire.encode(wire.GENERATE, "r", meta, tensors), LIMITS)
    with pytest.raises(wire.WireError, match=match) as info:
        codec.decode_generate_request(message)
    assert info.value.code == ErrorCode.BAD_REQUEST
