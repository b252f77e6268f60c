"""Real peers: the vllm backend behind the teacher service, and the openai client against vLLM's own
OpenAI-compatible server, both equal to transformers on the same tiny teacher.

Both servers start once per module, in parallel (each vLLM start costs tens of seconds on CPU), bind
only to 127.0.0.1 and are killed at the end.
"""

import socket

import numpy as np
import pytest

from megatron_gkd.teacher import GenerateBatch, RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher
from tests.e2e.teacher import procs

pytestmark = pytest.mark.e2e

MAX_LOGPROBS = 256
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_teacher(tmp_path_factory.mktemp("tiny_teacher"))


@pytest.fixture(scope="module")
def servers(teacher_dir, tmp_path_factory):
    """(zmq frontend address, openai base url): vLLM behind our service and vLLM's own server."""
    logs = tmp_path_factory.mktemp("logs")
    port = _free_port()
    openai_server = procs.spawn(
        ["-m", "vllm.entrypoints.openai.api_server", "--model", str(teacher_dir), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--max-logprobs", str(MAX_LOGPROBS),
         "--max-model-len", "1024", "--enforce-eager"], logs / "openai.log", env=VLLM_ENV)
    try:
        service = procs.start(
            ["launch/teacher_server.py", "serve", "--frontend", "tcp://127.0.0.1:0", "--backend", "vllm",
             "--model", str(teacher_dir), "--backend-arg", f"max_top_k={MAX_LOGPROBS}",
             "--backend-arg", "max_model_len=1024", "--backend-arg", "enforce_eager=true"],
            "READY frontend=", 600, logs / "service.log", env=VLLM_ENV)
    except BaseException:
        procs.stop(openai_server, kill=True)
        raise
    frontend = service.ready_line.split("frontend=")[1].split()[0]
    yield frontend, f"http://127.0.0.1:{port}"
    procs.stop(service)
    procs.stop(openai_server)


@pytest.fixture(scope="module")
def reference(teacher_dir):
    return ReferenceTeacher(teacher_dir)


def _batch(top_k: int, seed: int = 0) -> ScoreBatch:
    rng = np.random.default_rng(seed)
    shapes = ((2, 1), (30, 12), (17, 16), (41, 3))  # 1-token prompt, 1-token response, longer ones
    return ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(3, 512, n), response_start=s)
                                 for n, s in shapes], top_k=top_k)


@pytest.fixture(scope="module")
def zmq_client(servers):
    with build_client("zmq", address=servers[0], retry=RetryPolicy(attempt_timeout_s=120, deadline_s=240)) as client:
        yield client


@pytest.fixture(scope="module")
def openai_client(servers, teacher_dir):
    with build_client("openai", base_url=servers[1], teacher_tokenizer=str(teacher_dir), wait_ready_s=600,
                      retry=RetryPolicy(attempt_timeout_s=120, deadline_s=240)) as client:
        yield client


@pytest.mark.parametrize("top_k", [64, 256])
def test_vllm_backend_and_openai_peer_equal_transformers(zmq_client, openai_client, reference, top_k):
    batch = _batch(top_k, seed=top_k)
    from_service, from_openai = zmq_client.score(batch), openai_client.score(batch)
    for service_out, openai_out, sequence in zip(from_service, from_openai, batch.sequences, strict=True):
        reference.assert_matches(service_out, sequence.token_ids, sequence.response_start, top_k)
        reference.assert_matches(openai_out, sequence.token_ids, sequence.response_start, top_k)
        # Same engine, same numbers: the OpenAI JSON path loses nothing against the in-process path.
        np.testing.assert_array_equal(openai_out.topk_ids, service_out.topk_ids)
        np.testing.assert_allclose(openai_out.topk_logprobs, service_out.topk_logprobs, atol=1e-6)
        np.testing.assert_allclose(openai_out.token_logprobs, service_out.token_logprobs, atol=1e-6)


def test_start_up_checks(zmq_client, openai_client, teacher_dir):
    from transformers import AutoTokenizer

    student_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    assert openai_client.max_logprobs == MAX_LOGPROBS  # learned from the server at start-up
    assert zmq_client.align_vocab(student_tokenizer, 512).real_vocab_size == 512
    assert openai_client.align_vocab(student_tokenizer, 512).real_vocab_size == 512
    with pytest.raises(TeacherError, match="max_logprobs=256") as info:
        openai_client.score(_batch(MAX_LOGPROBS + 1))
    assert info.value.code == ErrorCode.UNSUPPORTED


def test_requested_ids_are_a_typed_error_on_vllm(zmq_client, openai_client):
    batch = _batch(4)
    tcad = ScoreBatch(sequences=[SequenceRequest(token_ids=s.token_ids, response_start=s.response_start,
                                                 requested_ids=np.zeros((s.num_response_tokens, 2)))
                                 for s in batch.sequences], top_k=4)
    for client in (zmq_client, openai_client):
        with pytest.raises(TeacherError) as info:
            client.score(tcad)
        assert info.value.code == ErrorCode.UNSUPPORTED


def _prompts(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, length) for length in (1, 7, 12)]


def test_vllm_and_openai_generate_valid_responses_scored_in_the_same_call(zmq_client, openai_client, reference):
    batch = GenerateBatch(prompts=_prompts(), num_samples=2, max_tokens=12, temperature=1.2, top_k=40, seed=5,
                          score_top_k=8)
    for client in (zmq_client, openai_client):
        samples = client.generate(batch)  # checked by the client: count, order, lengths, ids, stop ids
        assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
        assert len({s.response_ids.tobytes() for s in samples}) == len(samples)
        for sample in samples:
            prompt = batch.prompts[sample.prompt_index]
            reference.assert_matches(sample.output, np.concatenate([prompt, sample.response_ids]), len(prompt), 8)
        again = client.generate(batch)  # the seed repeats the samples
        assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(samples, again))


def test_vllm_and_openai_greedy_agree_and_stop_at_stop_ids(zmq_client, openai_client):
    greedy = GenerateBatch(prompts=_prompts(1), temperature=0, max_tokens=10, score_top_k=1)
    from_service, from_openai = zmq_client.generate(greedy), openai_client.generate(greedy)
    for a, b in zip(from_service, from_openai, strict=True):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)  # one engine behind both
        np.testing.assert_array_equal(a.response_ids, a.output.topk_ids[:, 0])  # the teacher's arg-max
    stop = int(from_service[1].response_ids[3])
    first = int(np.argmax(from_service[1].response_ids == stop))
    stopped = GenerateBatch(prompts=greedy.prompts[1:2], temperature=0, max_tokens=10, stop_ids=(stop,))
    for client in (zmq_client, openai_client):
        np.testing.assert_array_equal(client.generate(stopped)[0].response_ids,
                                      from_service[1].response_ids[:first + 1])
