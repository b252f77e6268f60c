"""ScoreBatch / TeacherOutput <-> wire messages, with schema validation of what arrives.

Sequences travel packed, not padded: a request carries the concatenated token ids and per-sequence
lengths; a result carries the concatenated rows of all responses (``[sum T, k]``, or ``[sum T, h]``
hidden states for the hidden signal). Ids travel as int32 (vocabularies are far below 2**31) and are
widened to the int64 of the TeacherOutput contract; hidden states travel in the requested float dtype
and are widened to float32.

A top-k request is the same bytes as before the hidden signal existed (protocol version 1); a hidden
request adds ``signal`` and ``hidden_dtype`` to its meta, which a peer that predates them refuses as
``bad_request`` (docs/teacher_protocol.md "Versions").
"""

from __future__ import annotations

import numpy as np

from megatron_gkd.teacher.protocol import wire
from megatron_gkd.teacher.protocol.types import (
    HIDDEN_DTYPES,
    MAX_STOP_IDS,
    TEACHER_SIGNALS,
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    SequenceRequest,
    TeacherError,
    TeacherOutput,
    TeacherOutputError,
    check_generated,
)

MAX_SEQUENCES = 65536
MAX_TOP_K = 65536
# The dtypes a SCORE request declares for its tensors (docs/teacher_protocol.md); others are refused.
_REQUEST_DTYPES = {"token_ids": "int32", "lengths": "int64", "response_starts": "int64",
                   "requested_ids": "int32"}
_SCORE_META = {"top_k", "temperature"}
_HIDDEN_META = {"signal", "hidden_dtype"}  # present together, in hidden requests only
_GENERATE_META = {"num_samples", "temperature", "top_p", "top_k", "max_tokens", "seed", "score_top_k",
                  "score_temperature"}
_GENERATE_TENSORS = {"prompt_ids": "int32", "prompt_lengths": "int64", "stop_ids": "int32"}
_GENERATED_DTYPES = {"response_ids": "int32", "topk_ids": "int32", "topk_logprobs": "float32",
                     "token_logprobs": "float32"}
MAX_SAMPLES = 1024  # responses per prompt; the worker's own bounds (WorkLimits) are tighter
MAX_NEW_TOKENS = 2**20


def result_row_bytes(batch: ScoreBatch, hidden_size: int | None = None) -> int:
    """Bytes one response row takes in the RESULT answering ``batch`` (``hidden_size``: h, hidden only).

    top-k: an int32 id and a float32 log-prob per entry, the token's float32 log-prob and m requested
    float32 log-probs. hidden: h values of the wire dtype and the token's float32 log-prob.
    """
    if batch.is_hidden:
        assert hidden_size is not None, "the size of a hidden result depends on the teacher's h"
        return hidden_size * wire.DTYPES[batch.hidden_dtype].itemsize + 4
    return 8 * batch.top_k + 4 * (1 + (batch.num_requested or 0))


def _ids_to_wire(ids: np.ndarray) -> np.ndarray:
    if ids.size and (ids.max() >= 2**31 or ids.min() < -(2**31)):
        raise ValueError("token ids must fit in int32 on the wire")
    return ids.astype(np.int32)


def encode_request(request_id: str, batch: ScoreBatch, secret: bytes | None) -> list[bytes]:
    """Frames of a SCORE request for ``batch``."""
    tensors = {
        "token_ids": _ids_to_wire(np.concatenate([s.token_ids for s in batch.sequences])),
        "lengths": np.array([len(s.token_ids) for s in batch.sequences], dtype=np.int64),
        "response_starts": np.array([s.response_start for s in batch.sequences], dtype=np.int64),
    }
    if batch.num_requested is not None:
        tensors["requested_ids"] = _ids_to_wire(np.concatenate([s.requested_ids for s in batch.sequences]))
    meta = {"top_k": batch.top_k, "temperature": batch.temperature}
    if batch.is_hidden:
        meta |= {"signal": batch.signal, "hidden_dtype": batch.hidden_dtype}
    return wire.encode(wire.SCORE, request_id, meta, tensors, secret)


def _bad(message: str) -> wire.WireError:
    return wire.WireError(ErrorCode.BAD_REQUEST, message)


def decode_request(message: wire.Message) -> ScoreBatch:
    """Validates a SCORE message and rebuilds its ScoreBatch; raises WireError(BAD_REQUEST)."""
    meta, tensors = message.meta, message.tensors
    if set(meta) not in (_SCORE_META, _SCORE_META | _HIDDEN_META):
        raise _bad(f"score meta keys {sorted(map(str, meta))} != {sorted(_SCORE_META)} "
                   f"[+ {sorted(_HIDDEN_META)}]")
    top_k, temperature = meta["top_k"], meta["temperature"]
    signal, hidden_dtype = meta.get("signal", "topk"), meta.get("hidden_dtype", "bfloat16")
    if signal not in TEACHER_SIGNALS or hidden_dtype not in HIDDEN_DTYPES:
        raise _bad(f"signal={str(signal)[:32]!r} must be one of {list(TEACHER_SIGNALS)} and hidden_dtype="
                   f"{str(hidden_dtype)[:32]!r} one of {list(HIDDEN_DTYPES)}")
    # type() rather than isinstance: True is an int to Python, and would score k=1.
    if not (type(top_k) is int and 1 <= top_k <= MAX_TOP_K):
        raise _bad(f"top_k={top_k!r} must be an int in [1, {MAX_TOP_K}]")
    if type(temperature) not in (int, float):
        raise _bad(f"temperature={temperature!r} must be a number")
    required = {"token_ids", "lengths", "response_starts"}
    if not required <= set(tensors) <= required | {"requested_ids"}:
        raise _bad(f"score tensors {sorted(tensors)} must be {sorted(required)} [+ requested_ids]")
    for key, array in tensors.items():
        if array.dtype != wire.DTYPES[_REQUEST_DTYPES[key]]:
            raise _bad(f"{key} must be {_REQUEST_DTYPES[key]}, got {array.dtype}")
    token_ids, lengths, starts = tensors["token_ids"], tensors["lengths"], tensors["response_starts"]
    requested = tensors.get("requested_ids")
    if token_ids.ndim != 1 or lengths.ndim != 1 or starts.shape != lengths.shape:
        raise _bad("token_ids must be [N], lengths and response_starts [B]")
    if not 1 <= len(lengths) <= MAX_SEQUENCES:
        raise _bad(f"a request holds 1..{MAX_SEQUENCES} sequences, got {len(lengths)}")
    # Bounding every length by N first keeps the int64 sum below 2**16 * 2**31: it cannot wrap.
    if lengths.min() < 2 or lengths.max() > len(token_ids) or int(lengths.sum()) != len(token_ids):
        raise _bad("lengths must be >= 2 and sum to len(token_ids)")
    if (starts < 1).any() or (starts >= lengths).any():
        raise _bad("every response_start must satisfy 1 <= response_start < length")
    num_rows = lengths - starts
    if requested is not None and (requested.ndim != 2 or requested.shape[0] != int(num_rows.sum())):
        raise _bad(f"requested_ids must be [sum T={int(num_rows.sum())}, m], got {requested.shape}")
    if token_ids.min() < 0 or (requested is not None and requested.size and requested.min() < 0):
        raise _bad("token ids must be >= 0")
    sequences, token_offset, row_offset = [], 0, 0
    try:  # a ValueError here is the request's fault: it must not pass for a backend failure
        for length, start, rows in zip(lengths.tolist(), starts.tolist(), num_rows.tolist()):
            sequences.append(SequenceRequest(
                token_ids=token_ids[token_offset:token_offset + length], response_start=start,
                requested_ids=None if requested is None else requested[row_offset:row_offset + rows]))
            token_offset, row_offset = token_offset + length, row_offset + rows
        return ScoreBatch(sequences=sequences, top_k=top_k, temperature=temperature, signal=signal,
                          hidden_dtype=hidden_dtype)
    except ValueError as error:
        raise _bad(str(error)) from None


def encode_result(request_id: str, outputs: list[TeacherOutput], secret: bytes | None,
                  hidden_dtype: str | None = None) -> list[bytes]:
    """Frames of a RESULT message holding ``outputs`` packed row-wise.

    Outputs of the hidden signal send their hidden states as ``hidden_dtype`` (the request's).

    Raises:
        TeacherError: UNSUPPORTED when a hidden state does not fit ``hidden_dtype`` (float16 past
            65504), which would arrive as inf.
    """
    tensors = {
        "num_rows": np.array([len(o.token_logprobs) for o in outputs], dtype=np.int64),
        "token_logprobs": np.concatenate([o.token_logprobs for o in outputs]).astype(np.float32),
    }
    if outputs[0].hidden is not None:
        assert hidden_dtype is not None, "hidden states need the request's hidden_dtype"
        hidden = wire.to_wire_float(np.concatenate([o.hidden for o in outputs]), hidden_dtype)
        if not np.isfinite(wire.from_wire_float(hidden)).all():
            raise TeacherError(ErrorCode.UNSUPPORTED, f"this teacher's hidden states overflow {hidden_dtype}; "
                               "request hidden_dtype=bfloat16 or float32")
        tensors["hidden"] = hidden
        return wire.encode(wire.RESULT, request_id, {}, tensors, secret)
    tensors["topk_ids"] = _ids_to_wire(np.concatenate([o.topk_ids for o in outputs]))
    tensors["topk_logprobs"] = np.concatenate([o.topk_logprobs for o in outputs]).astype(np.float32)
    if outputs[0].requested_logprobs is not None:
        tensors["requested_logprobs"] = np.concatenate(
            [o.requested_logprobs for o in outputs]).astype(np.float32)
    return wire.encode(wire.RESULT, request_id, {}, tensors, secret)


def decode_result(message: wire.Message, batch: ScoreBatch,
                  hidden_size: int | None = None) -> list[TeacherOutput]:
    """Splits a RESULT into validated TeacherOutputs, one per sequence of ``batch``; fails closed.

    Args:
        message: the decoded RESULT.
        batch: the request it answers; a result of the other signal is refused.
        hidden_size: the teacher's h (its INFO), required for a hidden-signal ``batch``.
    """
    tensors, name = message.tensors, f"request {message.request_id}"
    if batch.is_hidden:
        assert hidden_size is not None, "validating hidden states needs the teacher's hidden_size"
        expected = {"num_rows", "token_logprobs", "hidden"}
    else:
        hidden_size = None
        expected = {"num_rows", "topk_ids", "topk_logprobs", "token_logprobs"}
    if batch.num_requested is not None:
        expected.add("requested_logprobs")
    if set(tensors) != expected:
        raise TeacherOutputError(f"{name}: result tensors {sorted(tensors)} != {sorted(expected)} (the "
                                 f"{batch.signal} signal was requested)")
    num_rows = tensors["num_rows"]
    want_rows = [s.num_response_tokens for s in batch.sequences]
    if num_rows.tolist() != want_rows:
        raise TeacherOutputError(f"{name}: result has rows per sequence {num_rows.tolist()}, the "
                                 f"request had {want_rows}")
    total = sum(want_rows)
    for key in expected - {"num_rows"}:
        if tensors[key].shape[:1] != (total,):
            raise TeacherOutputError(f"{name}: {key} has shape {tensors[key].shape}, expected "
                                     f"{total} rows")
    hidden = None
    if batch.is_hidden:
        sent_as = wire.wire_float_dtype(tensors["hidden"])
        if sent_as != batch.hidden_dtype:
            raise TeacherOutputError(f"{name}: hidden came as {sent_as or tensors['hidden'].dtype}, "
                                     f"{batch.hidden_dtype} was requested")
        hidden = wire.from_wire_float(tensors["hidden"])  # a fresh float32 array: slices may share it
    outputs, offset = [], 0
    for index, (sequence, rows) in enumerate(zip(batch.sequences, want_rows)):
        part = slice(offset, offset + rows)
        requested = tensors.get("requested_logprobs")
        if batch.is_hidden:
            topk_ids, topk_logprobs = np.empty((rows, 0), np.int64), np.empty((rows, 0), np.float32)
        else:
            topk_ids, topk_logprobs = tensors["topk_ids"][part].astype(np.int64), tensors["topk_logprobs"][part].copy()
        output = TeacherOutput(
            topk_ids=topk_ids, topk_logprobs=topk_logprobs,
            token_logprobs=tensors["token_logprobs"][part].copy(),
            requested_logprobs=None if requested is None else requested[part].copy(),
            hidden=None if hidden is None else hidden[part])
        outputs.append(output.validate(rows, batch.top_k, batch.num_requested,
                                       name=f"sequence {index} of {name}", sequence=sequence,
                                       hidden_size=hidden_size))
        offset += rows
    return outputs


# ---- generate ------------------------------------------------------------------------------------
# A GENERATE request carries the prompts packed like a SCORE's sequences and the sampling parameters in
# its meta; the GENERATED reply carries the responses packed (``response_lengths`` per response, prompt
# by prompt) and, when ``score_top_k`` was asked, their rows as a top-k RESULT would.


def encode_generate_request(request_id: str, batch: GenerateBatch, secret: bytes | None) -> list[bytes]:
    """Frames of a GENERATE request for ``batch``."""
    tensors = {"prompt_ids": _ids_to_wire(np.concatenate(batch.prompts)),
               "prompt_lengths": np.array([len(p) for p in batch.prompts], dtype=np.int64),
               "stop_ids": _ids_to_wire(np.array(batch.stop_ids, dtype=np.int64))}
    meta = {name: getattr(batch, name) for name in sorted(_GENERATE_META)}
    return wire.encode(wire.GENERATE, request_id, meta, tensors, secret)


def decode_generate_request(message: wire.Message) -> GenerateBatch:
    """Validates a GENERATE message and rebuilds its GenerateBatch; raises WireError(BAD_REQUEST)."""
    meta, tensors = message.meta, message.tensors
    if set(meta) != _GENERATE_META:
        raise _bad(f"generate meta keys {sorted(map(str, meta))} != {sorted(_GENERATE_META)}")
    if set(tensors) != set(_GENERATE_TENSORS):
        raise _bad(f"generate tensors {sorted(tensors)} != {sorted(_GENERATE_TENSORS)}")
    for key, array in tensors.items():
        if array.dtype != wire.DTYPES[_GENERATE_TENSORS[key]] or array.ndim != 1:
            raise _bad(f"{key} must be a 1-D {_GENERATE_TENSORS[key]} tensor, got {array.dtype} {array.shape}")
    # type() rather than isinstance: True is an int to Python. Wire-level sanity only: the worker's
    # WorkLimits bound the work itself.
    for key, low, high in (("num_samples", 1, MAX_SAMPLES), ("max_tokens", 1, MAX_NEW_TOKENS),
                           ("top_k", 0, 2**31 - 1)):
        if not (type(meta[key]) is int and low <= meta[key] <= high):
            raise _bad(f"{key}={meta[key]!r} must be an int in [{low}, {high}]")
    for key in ("temperature", "top_p", "score_temperature"):
        if type(meta[key]) not in (int, float):
            raise _bad(f"{key}={meta[key]!r} must be a number")
    if meta["score_top_k"] is not None and not (type(meta["score_top_k"]) is int
                                                and 1 <= meta["score_top_k"] <= MAX_TOP_K):
        raise _bad(f"score_top_k={meta['score_top_k']!r} must be null or an int in [1, {MAX_TOP_K}]")
    prompt_ids, lengths, stop_ids = tensors["prompt_ids"], tensors["prompt_lengths"], tensors["stop_ids"]
    if not 1 <= len(lengths) <= MAX_SEQUENCES:
        raise _bad(f"a request holds 1..{MAX_SEQUENCES} prompts, got {len(lengths)}")
    # Bounding every length by N first keeps the int64 sum from wrapping (as for SCORE).
    if lengths.min() < 1 or lengths.max() > len(prompt_ids) or int(lengths.sum()) != len(prompt_ids):
        raise _bad("prompt_lengths must be >= 1 and sum to len(prompt_ids)")
    if len(stop_ids) > MAX_STOP_IDS:
        raise _bad(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
    if prompt_ids.min() < 0 or (stop_ids.size and stop_ids.min() < 0):
        raise _bad("token ids must be >= 0")
    bounds = np.cumsum(lengths)[:-1]
    try:  # a ValueError here is the request's fault: it must not pass for a backend failure
        return GenerateBatch(prompts=np.split(prompt_ids.astype(np.int64), bounds),
                             stop_ids=tuple(stop_ids.tolist()), **meta)
    except ValueError as error:
        raise _bad(str(error)) from None


def encode_generated(request_id: str, samples: list[GeneratedSample], secret: bytes | None) -> list[bytes]:
    """Frames of a GENERATED message holding ``samples`` (with their rows when they carry them)."""
    tensors = {"response_lengths": np.array([len(s.response_ids) for s in samples], dtype=np.int64),
               "response_ids": _ids_to_wire(np.concatenate([s.response_ids for s in samples]))}
    if samples[0].output is not None:
        outputs = [s.output for s in samples]
        tensors |= {"topk_ids": _ids_to_wire(np.concatenate([o.topk_ids for o in outputs])),
                    "topk_logprobs": np.concatenate([o.topk_logprobs for o in outputs]).astype(np.float32),
                    "token_logprobs": np.concatenate([o.token_logprobs for o in outputs]).astype(np.float32)}
    return wire.encode(wire.GENERATED, request_id, {}, tensors, secret)


def decode_generated(message: wire.Message, batch: GenerateBatch, vocab_size: int) -> list[GeneratedSample]:
    """Splits a GENERATED reply into validated samples (:func:`~megatron_gkd.teacher.protocol.types.check_generated`).

    Args:
        message: the decoded GENERATED.
        batch: the request it answers.
        vocab_size: the teacher's tokenizer size (its INFO): ids at or past it are refused.

    Raises:
        TeacherOutputError: naming the request and what is wrong; nothing partial is returned.
    """
    tensors, name = message.tensors, f"generate request {message.request_id}"
    expected = {"response_lengths", "response_ids"}
    if batch.score_top_k is not None:
        expected |= {"topk_ids", "topk_logprobs", "token_logprobs"}
    if set(tensors) != expected:
        raise TeacherOutputError(f"{name}: reply tensors {sorted(tensors)} != {sorted(expected)}")
    lengths, ids = tensors["response_lengths"], tensors["response_ids"]
    if lengths.dtype != np.int64 or lengths.shape != (batch.num_responses,):
        raise TeacherOutputError(f"{name}: {lengths.shape[0] if lengths.ndim else 0} responses for "
                                 f"{len(batch.prompts)} prompts x num_samples={batch.num_samples}; "
                                 f"expected {batch.num_responses}")
    if (lengths < 1).any() or (lengths > batch.max_tokens).any():
        index = int(np.argmax((lengths < 1) | (lengths > batch.max_tokens)))
        raise TeacherOutputError(f"{name}: response {index} has {int(lengths[index])} tokens; a response has "
                                 f"1..max_tokens={batch.max_tokens}")
    total = int(lengths.sum())  # bounded by max_tokens each: no wrap
    for key in sorted(expected - {"response_lengths"}):
        dtype, array = _GENERATED_DTYPES[key], tensors[key]
        if array.shape[:1] != (total,) or array.dtype != wire.DTYPES[dtype]:
            raise TeacherOutputError(f"{name}: {key} is {array.dtype} {array.shape}, expected {total} rows of "
                                     f"{dtype}")
    if ids.ndim != 1:
        raise TeacherOutputError(f"{name}: response_ids must be [sum T], got shape {ids.shape}")
    samples, offset = [], 0
    for index, length in enumerate(lengths.tolist()):
        part = slice(offset, offset + length)
        output = None
        if batch.score_top_k is not None:
            output = TeacherOutput(topk_ids=tensors["topk_ids"][part].astype(np.int64),
                                   topk_logprobs=tensors["topk_logprobs"][part].copy(),
                                   token_logprobs=tensors["token_logprobs"][part].copy())
        samples.append(GeneratedSample(prompt_index=index // batch.num_samples,
                                       response_ids=ids[part].astype(np.int64), output=output))
        offset += length
    return check_generated(samples, batch, vocab_size, name=name)
