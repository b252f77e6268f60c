"""The hidden signal on the wire: bf16/fp16/fp32 encodings, request and result schema, validation."""

import dataclasses
import pathlib

import numpy as np
import pytest
import torch

from megatron_gkd.teacher.clients import TeacherInfo
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import (
    HIDDEN_DTYPES,
    ErrorCode,
    ScoreBatch,
    SequenceRequest,
    TeacherError,
    TeacherOutput,
    TeacherOutputError,
)

LIMITS = wire.Limits(max_message_bytes=2**20)
HIDDEN = 48
ROOT = pathlib.Path(__file__).resolve().parents[3]


def _batch(hidden_dtype: str = "bfloat16", signal: str = "hidden") -> ScoreBatch:
    rng = np.random.default_rng(0)
    sequences = [SequenceRequest(token_ids=rng.integers(0, 100, n), response_start=s)
                 for n, s in ((9, 4), (5, 1), (12, 11))]
    return ScoreBatch(sequences=sequences, top_k=4, temperature=0.7, signal=signal, hidden_dtype=hidden_dtype)


def _output(rows: int, seed: int = 0, scale: float = 3.0) -> TeacherOutput:
    rng = np.random.default_rng(seed)
    return TeacherOutput(topk_ids=np.empty((rows, 0), np.int64), topk_logprobs=np.empty((rows, 0), np.float32),
                         token_logprobs=-rng.random(rows, dtype=np.float32),
                         hidden=(scale * rng.standard_normal((rows, HIDDEN))).astype(np.float32))


def _result(batch: ScoreBatch, outputs=None, **tensors) -> wire.Message:
    """The decoded RESULT for ``outputs`` (default: good ones), with ``tensors`` replaced or removed (None)."""
    outputs = outputs or [_output(s.num_response_tokens, i) for i, s in enumerate(batch.sequences)]
    message = wire.decode(codec.encode_result("r", outputs, None, batch.hidden_dtype), LIMITS)
    for name, array in tensors.items():
        if array is None:
            message.tensors.pop(name)
        else:
            message.tensors[name] = array
    return message


def test_bfloat16_bits_are_torchs_round_to_nearest_even():
    rng = np.random.default_rng(1)
    finfo = np.finfo(np.float32)
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, finfo.max, -finfo.max, finfo.tiny,
                        finfo.tiny / 8, finfo.smallest_subnormal, 3.3895314e38, 65504.0, 1e-40], np.float32)
    # Exact ties between two bfloat16 values (the low 16 bits 0x8000), on both parities of the kept bit.
    ties = (rng.integers(0, 2**15, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    scaled = (rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)
    patterns = rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([special, ties, scaled, patterns])
    values = values[~np.isnan(values)]
    assert values.dtype == np.float32
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(wire.float32_to_bfloat16_bits(values), want)
    widened = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(wire.bfloat16_bits_to_float32(want), widened)
    # A NaN stays a NaN (torch's bits for it vary by code path): the carry must not make it inf.
    nans = np.array([0x7F800001, 0xFFFFFFFF, 0x7FC00000], np.uint32).view(np.float32)
    assert np.isnan(wire.bfloat16_bits_to_float32(wire.float32_to_bfloat16_bits(nans))).all()


@pytest.mark.parametrize("hidden_dtype", HIDDEN_DTYPES)
@pytest.mark.parametrize("secret", [None, b"shared-secret-of-32-bytes-length"])
def test_hidden_request_and_result_roundtrip(hidden_dtype, secret):
    batch = _batch(hidden_dtype)
    decoded = codec.decode_request(wire.decode(codec.encode_request("r1", batch, secret), LIMITS, secret))
    assert (decoded.signal, decoded.hidden_dtype, decoded.temperature) == ("hidden", hidden_dtype, 0.7)
    outputs = [_output(s.num_response_tokens, i) for i, s in enumerate(batch.sequences)]
    frames = codec.encode_result("r1", outputs, secret, hidden_dtype)
    message = wire.decode(frames, LIMITS, secret)
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[hidden_dtype]
    rows = sum(s.num_response_tokens for s in batch.sequences)
    assert message.tensors["hidden"].nbytes == rows * HIDDEN * itemsize
    assert codec.result_row_bytes(batch, HIDDEN) == HIDDEN * itemsize + 4
    got = codec.decode_result(message, batch, HIDDEN)
    torch_dtype = getattr(torch, hidden_dtype)
    for a, b in zip(got, outputs, strict=True):
        assert a.hidden.dtype == np.float32 and a.topk_ids.shape == (len(b.token_logprobs), 0)
        # Exactly the wire dtype's values, widened: torch's own rounding for bf16 and fp16.
        np.testing.assert_array_equal(a.hidden, torch.from_numpy(b.hidden).to(torch_dtype).float().numpy())
        np.testing.assert_array_equal(a.token_logprobs, b.token_logprobs)
        assert a.requested_logprobs is None


def test_a_top_k_request_is_the_same_bytes_as_before_the_hidden_signal():
    message = wire.decode(codec.encode_request("r", _batch(signal="topk"), None), LIMITS)
    assert set(message.meta) == {"top_k", "temperature"}  # what a version-1 peer without hidden accepts
    assert codec.decode_request(message).signal == "topk"


def _score_message(meta: dict, requested: bool = False) -> wire.Message:
    tensors = {"token_ids": np.arange(10, dtype=np.int32), "lengths": np.array([4, 6], np.int64),
               "response_starts": np.array([1, 2], np.int64)}
    if requested:
        tensors["requested_ids"] = np.zeros((7, 2), np.int32)
    return wire.decode(wire.encode(wire.SCORE, "r", meta, tensors), LIMITS)


@pytest.mark.parametrize("meta, requested", [
    ({"signal": "logits", "hidden_dtype": "bfloat16"}, False),
    ({"signal": "hidden", "hidden_dtype": "int8"}, False),
    ({"signal": "hidden", "hidden_dtype": ["bfloat16"]}, False),
    ({"signal": "hidden"}, False),  # the two keys travel together
    ({"signal": "hidden", "hidden_dtype": "float16"}, True),  # requested ids are top-k only
], ids=["signal", "dtype", "dtype_type", "half_meta", "requested_ids"])
def test_bad_hidden_requests_are_bad_requests(meta, requested):
    with pytest.raises(wire.WireError) as info:
        codec.decode_request(_score_message({"top_k": 4, "temperature": 1.0} | meta, requested))
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_score_batch_refuses_bad_signals_and_requested_ids_with_hidden():
    sequence = SequenceRequest(token_ids=np.arange(6), response_start=2, requested_ids=np.zeros((4, 2)))
    with pytest.raises(ValueError, match="drop requested_ids"):
        ScoreBatch(sequences=[sequence], top_k=4, signal="hidden")
    with pytest.raises(ValueError, match="signal"):
        ScoreBatch(sequences=[sequence], top_k=4, signal="logits")
    with pytest.raises(ValueError, match="hidden_dtype"):
        ScoreBatch(sequences=[sequence], top_k=4, hidden_dtype="float64")


def test_validate_hidden_fails_closed_and_names_the_sequence():
    good = _output(5)
    good.validate(5, 4, name="sequence 7", hidden_size=HIDDEN)
    nan, inf = good.hidden.copy(), good.hidden.copy()
    nan[3, 2], inf[1, 0] = np.nan, np.inf
    cases = {
        "wrong h": (dataclasses.replace(good, hidden=good.hidden[:, :-1]), "shape"),
        "NaN": (dataclasses.replace(good, hidden=nan), "non-finite value.*row 3"),
        "inf": (dataclasses.replace(good, hidden=inf), "non-finite value.*row 1"),
        "missing": (dataclasses.replace(good, hidden=None), "hidden missing"),
        "missing row": (dataclasses.replace(good, hidden=good.hidden[:4]), "shape"),
        "float64": (dataclasses.replace(good, hidden=good.hidden.astype(np.float64)), "float32"),
        "top-k entries": (dataclasses.replace(good, topk_ids=np.zeros((5, 1), np.int64),
                                              topk_logprobs=np.zeros((5, 1), np.float32)), "shape"),
        "NaN log-prob": (dataclasses.replace(good, token_logprobs=np.full(5, np.nan, np.float32)), "NaN"),
        "-inf log-prob": (dataclasses.replace(good, token_logprobs=np.full(5, -np.inf, np.float32)), "-inf"),
    }
    for _what, (output, match) in cases.items():
        with pytest.raises(TeacherOutputError, match=f"sequence 7: .*{match}"):
            output.validate(5, 4, name="sequence 7", hidden_size=HIDDEN)
    with pytest.raises(TeacherOutputError, match="hidden present although the top-k"):
        good.validate(5, 0, name="sequence 7")


@pytest.mark.parametrize("case, match", [
    ("wrong_dtype", "came as float32, bfloat16 was requested"),
    ("shape_lie", r"sequence 0 .*hidden has shape \(5, 47\), expected \(5, 48\)"),
    ("nan", "non-finite"),
    ("topk_result", "the hidden signal was requested"),
    ("missing_hidden", "the hidden signal was requested"),
    ("missing_row", "expected 10 rows"),
])
def test_decode_result_refuses_a_hidden_result_that_breaks_the_contract(case, match):
    batch = _batch("bfloat16")
    hidden = _result(batch).tensors["hidden"]
    if case == "wrong_dtype":
        message = _result(batch, hidden=wire.bfloat16_bits_to_float32(hidden))
    elif case == "shape_lie":  # a consistent header for another h: the wire accepts it, the schema not
        message = _result(batch, hidden=hidden[:, :-1].copy())
    elif case == "nan":
        bits = hidden.copy()
        bits[5, 7] = 0x7FC0
        message = _result(batch, hidden=bits)
    elif case == "topk_result":
        message = _result(batch, hidden=None, topk_ids=np.zeros((10, 4), np.int32),
                          topk_logprobs=np.zeros((10, 4), np.float32))
    elif case == "missing_hidden":
        message = _result(batch, hidden=None)
    else:
        message = _result(batch, hidden=hidden[:-1].copy())
    with pytest.raises(TeacherOutputError, match=match):
        codec.decode_result(message, batch, HIDDEN)


def test_a_hidden_result_to_a_top_k_request_is_refused():
    hidden_batch, topk_batch = _batch(), _batch(signal="topk")
    with pytest.raises(TeacherOutputError, match="the topk signal was requested"):
        codec.decode_result(_result(hidden_batch), topk_batch)


def test_float16_overflow_is_refused_by_the_teacher_not_sent_as_inf():
    batch = _batch("float16")
    outputs = [_output(s.num_response_tokens, i, scale=1e5) for i, s in enumerate(batch.sequences)]
    with pytest.raises(TeacherError, match="overflow float16") as info:
        codec.encode_result("r", outputs, None, "float16")
    assert info.value.code == ErrorCode.UNSUPPORTED
    codec.encode_result("r", outputs, None, "bfloat16")


def test_teacher_info_defaults_to_top_k_and_refuses_inconsistent_hidden_facts():
    facts = dict(vocab_size=10, tokenizer_size=10, tokenizer_digest="d", max_top_k=4,
                 supports_requested_ids=True, supports_temperature=True)
    old = TeacherInfo(**facts)  # a server that predates the hidden signal
    assert (old.hidden_size, old.signals) == (None, ["topk"])
    with pytest.raises(ValueError, match="teacher.client=local"):
        old.check_signal(_batch(), "the teacher at tcp://x")
    old.check_signal(_batch(signal="topk"), "the teacher at tcp://x")
    for bad in (dict(hidden_size=0, signals=["topk", "hidden"]), dict(hidden_size=True, signals=["topk", "hidden"]),
                dict(hidden_size=8, signals=["topk"]), dict(hidden_size=None, signals=["hidden"]),
                dict(hidden_size=8, signals="hidden")):
        with pytest.raises(ValueError):
            TeacherInfo(**facts, **bad)


@pytest.mark.parametrize("overrides, message", [
    (["teacher.serve.backend=vllm"], "teacher.serve.backend=vllm cannot return; use teacher.serve.backend=hf or megatron"),
    (["teacher.serve.model=null", "teacher.client=openai", "teacher.base_url=http://127.0.0.1:8000",
      "teacher.head_checkpoint=/tmp/teacher"], "an OpenAI-compatible server cannot return"),
])
def test_config_refuses_the_hidden_signal_where_no_hidden_states_come_back(overrides, message):
    from megatron_gkd.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(ROOT / "configs" / "cpu_tiny.yaml", ["teacher.signal=hidden", *overrides])
    load_config(ROOT / "configs" / "cpu_tiny.yaml", ["teacher.signal=hidden"])  # hf serves hidden
