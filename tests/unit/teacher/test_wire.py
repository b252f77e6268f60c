"""Wire format, TeacherOutput contract, vocabulary checks and registries (no model, no sockets)."""

import dataclasses
import pickle

import msgpack
import numpy as np
import pytest

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.teacher.backends import backend_names, build_backend
from megatron_gkd.teacher.clients import build_client, client_names
from megatron_gkd.teacher.clients.vocab import check_vocab, restrict_to_vocab
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import ErrorCode, ScoreBatch, SequenceRequest, TeacherOutput, TeacherOutputError
from megatron_gkd.teacher.service.server import Proxy, check_exposure, is_loopback

SECRET = b"shared-secret-of-32-bytes-length"
LIMITS = wire.Limits(max_message_bytes=2**20)


def _batch(requested: bool = False) -> ScoreBatch:
    rng = np.random.default_rng(0)
    sequences = [SequenceRequest(token_ids=rng.integers(0, 100, n), response_start=s,
                                 requested_ids=rng.integers(0, 100, (n - s, 3)) if requested else None)
                 for n, s in ((9, 4), (5, 1), (12, 11))]
    return ScoreBatch(sequences=sequences, top_k=4, temperature=0.7)


def _output(rows: int, k: int, requested: int | None = None, sequence: SequenceRequest | None = None
            ) -> TeacherOutput:
    """A consistent output: the log-probs of the response tokens and requested ids of ``sequence``
    (default: id 0, and ids 0..m-1, on every row) come from the same distribution as the top-k."""
    rng = np.random.default_rng(rows)
    logits = rng.normal(size=(rows, 100))
    logprobs = (logits - np.log(np.exp(logits).sum(1, keepdims=True))).astype(np.float32)
    ids = np.argsort(-logprobs, axis=1)[:, :k]
    response = np.zeros(rows, dtype=np.int64) if sequence is None else sequence.response_ids
    wanted = np.arange(requested or 0)[None].repeat(rows, 0) if sequence is None else sequence.requested_ids
    return TeacherOutput(topk_ids=ids.astype(np.int64),
                         topk_logprobs=np.take_along_axis(logprobs, ids, 1),
                         token_logprobs=logprobs[np.arange(rows), response].copy(),
                         requested_logprobs=None if requested is None else np.take_along_axis(logprobs, wanted, 1))


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("requested", [False, True])
def test_request_and_result_roundtrip(secret, requested):
    batch = _batch(requested)
    message = wire.decode(codec.encode_request("r1", batch, secret), LIMITS, secret)
    decoded = codec.decode_request(message)
    assert decoded.top_k == 4 and decoded.temperature == 0.7
    for a, b in zip(decoded.sequences, batch.sequences, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        assert a.response_start == b.response_start
        if requested:
            np.testing.assert_array_equal(a.requested_ids, b.requested_ids)
    outputs = [_output(s.num_response_tokens, 4, 3 if requested else None, s)
               for s in batch.sequences]
    result = wire.decode(codec.encode_result("r1", outputs, secret), LIMITS, secret)
    for got, want in zip(codec.decode_result(result, batch), outputs, strict=True):
        for field in dataclasses.fields(TeacherOutput):
            a, b = getattr(got, field.name), getattr(want, field.name)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)


def test_hmac_rejects_tampering_and_wrong_secret():
    frames = codec.encode_request("r1", _batch(), SECRET)
    tampered = list(frames)
    tampered[2] = bytes([tampered[2][0] ^ 1]) + tampered[2][1:]
    for bad, secret in ((tampered, SECRET), (frames, b"other"), (frames, None),
                        (codec.encode_request("r1", _batch(), None), SECRET)):
        with pytest.raises(wire.WireError) as info:
            wire.decode(bad, LIMITS, secret)
        assert info.value.code == ErrorCode.BAD_SIGNATURE


def _header(frames):
    return msgpack.unpackb(frames[1])


def _with_header(frames, **changes):
    header = _header(frames)
    header.update(changes)
    return [frames[0], msgpack.packb(header), *frames[2:]]


@pytest.mark.parametrize("mutate, code", [
    (lambda f: _with_header(f, v=2), ErrorCode.BAD_VERSION),
    (lambda f: [f[0], f[1], *f[2:-1], f[-1][:-3]], ErrorCode.BAD_FRAME),  # truncated buffer
    (lambda f: f[:-1], ErrorCode.BAD_FRAME),  # missing buffer
    (lambda f: [f[0], b"\xc1garbage", *f[2:]], ErrorCode.BAD_FRAME),
    (lambda f: [f[0], pickle.dumps({"v": 1}), *f[2:]], ErrorCode.BAD_FRAME),
    (lambda f: [f[0], msgpack.packb(msgpack.ExtType(1, b"x")), *f[2:]], ErrorCode.BAD_FRAME),
    (lambda f: [*f[:2], b"\0" * (2**20 + 1)], ErrorCode.TOO_LARGE),
    (lambda f: _with_header(f, type="result"), ErrorCode.BAD_REQUEST),
    (lambda f: _with_header(f, tensors=[dict(t, dtype="object") for t in _header(f)["tensors"]]),
     ErrorCode.BAD_FRAME),
    (lambda f: _with_header(f, extra=1), ErrorCode.BAD_FRAME),
])
def test_malformed_messages_get_typed_errors(mutate, code):
    frames = codec.encode_request("r1", _batch(), None)
    with pytest.raises(wire.WireError) as info:
        wire.decode(mutate(frames), LIMITS, None, expect=(wire.SCORE,))
    assert info.value.code == code


@pytest.mark.parametrize("meta, tensor_change", [
    ({"top_k": 0, "temperature": 1.0}, None),
    ({"top_k": 4}, None),
    ({"top_k": 4, "temperature": 1.0}, ("response_starts", np.array([0, 1, 1]))),
    ({"top_k": 4, "temperature": 1.0}, ("lengths", np.array([9, 5, 13]))),
    ({"top_k": 4, "temperature": 1.0}, ("token_ids", -np.ones(26, dtype=np.int32))),
])
def test_schema_violations_are_bad_requests(meta, tensor_change):
    batch = _batch()
    tensors = {"token_ids": np.concatenate([s.token_ids for s in batch.sequences]).astype(np.int32),
               "lengths": np.array([9, 5, 12]), "response_starts": np.array([4, 1, 11])}
    if tensor_change:
        tensors[tensor_change[0]] = tensor_change[1]
    message = wire.decode(wire.encode(wire.SCORE, "r", meta, tensors), LIMITS)
    with pytest.raises(wire.WireError) as info:
        codec.decode_request(message)
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_validate_fails_closed_and_names_the_sequence():
    good = _output(5, 4, 2)
    good.validate(5, 4, 2, name="sequence 7")
    cases = {
        "missing row": dataclasses.replace(good, topk_ids=good.topk_ids[:4]),
        "NaN": dataclasses.replace(good, token_logprobs=np.where(np.arange(5) == 2, np.nan,
                                                                 good.token_logprobs).astype(np.float32)),
        "zero padding": dataclasses.replace(good, topk_logprobs=np.concatenate(
            [good.topk_logprobs[:, :3], np.zeros((5, 1), np.float32)], 1)),
        "fewer than k": dataclasses.replace(good, topk_logprobs=good.topk_logprobs[:, :3],
                                            topk_ids=good.topk_ids[:, :3]),
        "no requested": dataclasses.replace(good, requested_logprobs=None),
        "wrong dtype": dataclasses.replace(good, topk_ids=good.topk_ids.astype(np.int32)),
        "repeated id": dataclasses.replace(good, topk_ids=np.concatenate(
            [good.topk_ids[:, :3], good.topk_ids[:, :1]], 1)),
    }
    for _what, output in cases.items():
        with pytest.raises(TeacherOutputError, match="sequence 7"):
            output.validate(5, 4, 2, name="sequence 7")
    padded = good.topk_logprobs.copy()
    padded[:, 3] = -np.inf  # fewer than k real entries, padded with -inf: allowed
    dataclasses.replace(good, topk_logprobs=padded).validate(5, 4, 2)


class _Tokenizer:
    def __init__(self, words):
        self._vocab = {w: i for i, w in enumerate(words)}

    def get_vocab(self):
        return dict(self._vocab)

    def __len__(self):
        return len(self._vocab)


def test_vocab_check_padded_tables_and_mismatch(caplog):
    words = [f"t{i}" for i in range(100)]
    teacher, student = _Tokenizer(words), _Tokenizer(words)
    with caplog.at_level("INFO"):
        alignment = check_vocab(teacher_vocab_size=128, teacher_tokenizer_size=100,
                                teacher_digest=tokenizer_digest(teacher), student_vocab_size=112,
                                student_tokenizer=student)
    assert alignment.real_vocab_size == 100 and "ignored" in caplog.text
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        check_vocab(teacher_vocab_size=128, teacher_tokenizer_size=100,
                    teacher_digest=tokenizer_digest(_Tokenizer(words[::-1])),
                    student_vocab_size=128, student_tokenizer=student)
    output = _output(3, 4)
    output.topk_ids[:, 1] = [100, 120, 5]  # padded ids in slot 1 of rows 0 and 1
    restricted = restrict_to_vocab(output, 100).validate(3, 4)
    assert (restricted.topk_ids < 100).all()
    np.testing.assert_array_equal(restricted.topk_logprobs[:2, 3], [-np.inf, -np.inf])
    np.testing.assert_array_equal(restricted.topk_logprobs[:2, :3], output.topk_logprobs[:2, [0, 2, 3]])
    np.testing.assert_array_equal(restricted.topk_logprobs[2], output.topk_logprobs[2])


def test_registries_know_every_backend_and_client():
    assert {"hf", "vllm", "megatron"} <= set(backend_names())
    assert {"zmq", "openai", "local"} <= set(client_names())
    with pytest.raises(ValueError, match="unknown"):
        build_backend("nope")
    with pytest.raises(ValueError, match="unknown"):
        build_client("nope")


def test_non_loopback_needs_secret_or_insecure(caplog):
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    with pytest.raises(ValueError, match="--insecure"):
        check_exposure("tcp://0.0.0.0:5555", None, False)
    check_exposure("tcp://0.0.0.0:5555", SECRET, False)
    with pytest.raises(ValueError, match="reachable from other hosts"):
        Proxy("tcp://0.0.0.0:0", "tcp://127.0.0.1:0")
    with caplog.at_level("WARNING"):
        check_exposure("tcp://10.0.0.1:5555", None, True)
    assert "WITHOUT authentication" in caplog.text


def test_teacher_config_validates_and_warns_on_inert_options(caplog):
    from megatron_gkd.teacher.config import TeacherConfig, build_client_from_config

    with pytest.raises(ValueError, match="teacher.address is required"):
        TeacherConfig(client="zmq")
    with pytest.raises(ValueError, match="unknown"):
        TeacherConfig(client="grpc")
    with caplog.at_level("WARNING"):
        TeacherConfig(client="zmq", address="tcp://127.0.0.1:5555", base_url="http://x")
    assert "teacher.base_url has no effect" in caplog.text
    with pytest.raises(ValueError, match="teacher.checkpoint is required"):
        TeacherConfig(client="local")
    with caplog.at_level("WARNING"):
        TeacherConfig(client="zmq", address="tcp://127.0.0.1:5555", offload=True)
    assert "teacher.offload has no effect" in caplog.text
    with build_client_from_config(TeacherConfig(client="zmq", address="tcp://127.0.0.1:5555",
                                                deadline_s=7)) as client:
        assert client.address == "tcp://127.0.0.1:5555" and client._retry.deadline_s == 7


def test_validate_refuses_unnormalised_top_k():
    good = _output(5, 4)
    good.validate(5, 4)
    # Four entries of log(0.5) each are all <= 0, sorted and distinct, but sum to probability 2.
    halves = np.full((5, 4), np.log(0.5), np.float32)
    with pytest.raises(TeacherOutputError, match="sequence 2.*normalised"):
        dataclasses.replace(good, topk_logprobs=halves).validate(5, 4, name="sequence 2")


def test_token_logprobs_must_agree_with_the_top_k_entry_of_the_same_id():
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=np.arange(8), response_start=3)], top_k=4)
    rows = batch.sequences[0].num_response_tokens
    output = _output(rows, 4)
    # Each row's own response token is placed in the top-k with a different log-prob than it reports.
    ids = output.topk_ids.copy()
    ids[:, 1] = batch.sequences[0].response_ids
    ids[:, 2:] = np.where(ids[:, 2:] == ids[:, 1:2], 99, ids[:, 2:])
    bad = dataclasses.replace(output, topk_ids=ids,
                              token_logprobs=(output.topk_logprobs[:, 1] - 1.0).astype(np.float32))
    message = wire.decode(codec.encode_result("r", [bad], None), LIMITS)
    with pytest.raises(TeacherOutputError, match="token_logprobs.*row 0"):
        codec.decode_result(message, batch)
    agreeing = dataclasses.replace(bad, token_logprobs=bad.topk_logprobs[:, 1].copy())
    codec.decode_result(wire.decode(codec.encode_result("r", [agreeing], None), LIMITS), batch)


def _score_message(lengths, starts, token_ids, meta=None):
    tensors = {"token_ids": token_ids, "lengths": lengths, "response_starts": starts}
    return wire.decode(wire.encode(wire.SCORE, "r", meta or {"top_k": 4, "temperature": 1.0}, tensors),
                       LIMITS)


@pytest.mark.parametrize("case", ["wrapping_lengths", "float_lengths", "nan_lengths", "bool_top_k",
                                  "int64_token_ids"])
def test_score_fields_that_used_to_reach_the_backend_are_bad_requests(case):
    tokens = np.arange(10, dtype=np.int32)
    lengths, starts, meta = np.array([4, 6], np.int64), np.array([1, 2], np.int64), None
    if case == "wrapping_lengths":  # the int64 sum wraps around to len(token_ids)
        lengths = np.array([2**62, 2**62, 2**62, 2**62 + 10], np.int64)
        starts = np.ones(4, np.int64)
    elif case == "float_lengths":
        lengths = np.array([4.0, 6.0], np.float32)
    elif case == "nan_lengths":
        lengths = np.array([np.nan, 10.0], np.float32)
    elif case == "bool_top_k":
        meta = {"top_k": True, "temperature": 1.0}
    else:
        tokens = tokens.astype(np.int64)
    with pytest.raises(wire.WireError) as info:
        codec.decode_request(_score_message(lengths, starts, tokens, meta))
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_weak_or_exposed_secrets_are_refused_before_a_non_loopback_bind(tmp_path):
    from megatron_gkd.teacher.clients.zmq_client import load_secret

    with pytest.raises(ValueError, match="at least 16 random bytes"):
        check_exposure("tcp://0.0.0.0:5555", b"short-secret", False)
    check_exposure("tcp://127.0.0.1:5555", b"short-secret", False)  # loopback needs no secret at all
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"a-secret-of-at-least-16-bytes\n")
    secret_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_secret(str(secret_file))
    secret_file.chmod(0o600)
    assert load_secret(str(secret_file)) == b"a-secret-of-at-least-16-bytes"
