"""The teacher service end to end in one process: zmq client -> proxy -> hf worker, on loopback."""

import dataclasses

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher
from tests.unit.teacher.conftest import LIMITS, SECRET, random_sequences

VOCAB = 512


@pytest.fixture(scope="module")
def reference(teacher_dir):
    return ReferenceTeacher(teacher_dir)


@pytest.fixture()
def client(service):
    proxy, _ = service
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET,
                      retry=RetryPolicy(attempt_timeout_s=30, deadline_s=60)) as client:
        yield client


@pytest.mark.parametrize("top_k, temperature", [(1, 1.0), (64, 1.0), (256, 0.5)])
def test_hf_backend_through_zmq_matches_transformers(client, reference, top_k, temperature):
    sequences = random_sequences(6, VOCAB, seed=top_k)
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=s) for ids, s in sequences],
                       top_k=top_k, temperature=temperature)
    outputs = client.score(batch)
    assert len(outputs) == len(sequences)
    for output, (ids, start) in zip(outputs, sequences):
        # Every row is compared, so row 0 (first response token) and the last token are included;
        # sequence 0 has a 1-token prompt and sequence 1 a 1-token response.
        reference.assert_matches(output, ids, start, top_k, temperature)


def test_requested_ids_tcad(client, reference):
    rng = np.random.default_rng(5)
    sequences = random_sequences(4, VOCAB, seed=5)
    requested = [rng.integers(0, VOCAB, (len(ids) - s, 7)) for ids, s in sequences]
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=s, requested_ids=r)
                                  for (ids, s), r in zip(sequences, requested)], top_k=8)
    for output, (ids, start), req in zip(client.score(batch), sequences, requested):
        assert output.requested_logprobs.shape == (len(ids) - start, 7)
        reference.assert_matches(output, ids, start, 8, requested_ids=req)


def test_async_futures_overlap_and_equal_sync(client):
    batches = [ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=s)
                                     for ids, s in random_sequences(3, VOCAB, seed=seed)], top_k=16)
               for seed in range(4)]
    futures = [client.score_async(batch) for batch in batches]
    for future, batch in zip(futures, batches):
        for got, want in zip(future.result(timeout=60), client.score(batch)):
            np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
            np.testing.assert_array_equal(got.topk_logprobs, want.topk_logprobs)


def test_typed_errors_reach_the_client(client):
    too_big = ScoreBatch(sequences=[SequenceRequest(token_ids=[3, 4, 5], response_start=1)], top_k=VOCAB + 1)
    with pytest.raises(TeacherError) as info:
        client.score(too_big)
    assert info.value.code == ErrorCode.UNSUPPORTED
    out_of_vocab = ScoreBatch(sequences=[SequenceRequest(token_ids=[3, VOCAB + 7], response_start=1)], top_k=2)
    with pytest.raises(TeacherError) as info:
        client.score(out_of_vocab)
    assert info.value.code == ErrorCode.BAD_REQUEST and "vocabulary" in str(info.value)


def test_wrong_secret_is_refused_with_a_clear_error(service):
    proxy, _ = service
    with build_client("zmq", address=proxy.frontend_address, secret=b"wrong",
                      # Every unsigned refusal is retried (it may be forged) until the attempts run out: short pauses
                      # between them, not the default 0.5 s doubling (15 s of this test's time).
                      retry=RetryPolicy(attempt_timeout_s=10, deadline_s=20, backoff_s=0.05, backoff_max_s=0.1)) as client:
        with pytest.raises(TeacherError) as info:
            client.info()
    assert info.value.code == ErrorCode.BAD_SIGNATURE


def test_vocab_alignment_at_startup(client, teacher_dir, tmp_path):
    student_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    alignment = client.align_vocab(student_tokenizer, student_vocab_size=VOCAB + 64)  # padded student
    assert alignment.real_vocab_size == VOCAB
    other = AutoTokenizer.from_pretrained(build_tiny_teacher(tmp_path / "other", vocab_size=VOCAB,
                                                             tokenizer_size=VOCAB - 1, num_layers=1))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        client.align_vocab(other, student_vocab_size=VOCAB)


def test_padded_teacher_table_ignores_ids_past_the_tokenizer(tmp_path, caplog):
    directory = build_tiny_teacher(tmp_path / "padded", vocab_size=VOCAB + 32, tokenizer_size=VOCAB,
                                   num_layers=1, seed=3)
    with caplog.at_level("INFO"):
        backend = build_backend("hf", model=str(directory))
    assert "ignored" in caplog.text
    ids, start = random_sequences(2, VOCAB, seed=9)[1]
    output = backend.score(ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start)],
                                      top_k=VOCAB))[0]
    assert output.topk_ids.max() < VOCAB
    ReferenceTeacher(directory).assert_matches(output, ids, start, VOCAB, vocab_limit=VOCAB)


def test_reference_check_catches_an_off_by_one_row(client, reference):
    ids, start = random_sequences(3, VOCAB, seed=11)[2]
    output = client.score(ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start)],
                                     top_k=8))[0]
    reference.assert_matches(output, ids, start, 8)
    shifted = dataclasses.replace(output, topk_ids=np.roll(output.topk_ids, 1, axis=0),
                                  topk_logprobs=np.roll(output.topk_logprobs, 1, axis=0))
    with pytest.raises(AssertionError):
        reference.assert_matches(shifted, ids, start, 8)


def test_oversize_results_fail_fast_on_both_sides(service, teacher_dir):
    proxy, _ = service
    ids, start = random_sequences(3, VOCAB, seed=2)[2]
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start)] * 64, top_k=VOCAB)
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=LIMITS) as client:
        with pytest.raises(ValueError, match="smaller batches"):
            client.score(batch)  # the client knows the answer would not fit, before sending
    from megatron_gkd.teacher.protocol import wire
    roomy = wire.Limits(max_message_bytes=2**26)  # a client with a larger limit than the server's
    with build_client("zmq", address=proxy.frontend_address, secret=SECRET, limits=roomy,
                      retry=RetryPolicy(attempt_timeout_s=30, deadline_s=60)) as client:
        with pytest.raises(TeacherError) as info:
            client.score(batch)
        assert info.value.code == ErrorCode.TOO_LARGE
        assert client.score(ScoreBatch(sequences=batch.sequences[:1], top_k=8))  # server still serves
