"""The teacher wire format: one msgpack header plus raw little-endian tensor buffers (docs/teacher_protocol.md).

A message is a list of ZMQ frames ``[mac, header, buffer_0, ..., buffer_{n-1}]``:

* ``mac``: 32-byte HMAC-SHA256 over every following frame (each prefixed with its 8-byte length) when a
  shared secret is configured, else empty. It is checked, in constant time, before anything is parsed.
* ``header``: msgpack map ``{"v": version, "id": request id, "type": message type, "tensors":
  [{"name", "dtype", "shape", "nbytes"}], "meta": {...}}``.
* buffers: one per ``tensors`` entry, decoded with ``numpy.frombuffer`` and a dtype from a fixed
  allow-list. Nothing received is ever unpickled or ``torch.load``-ed. numpy has no bfloat16: a
  ``bfloat16`` tensor is carried as its raw 16-bit patterns and held as ``uint16`` (:data:`BFLOAT16`);
  :func:`to_wire_float` and :func:`from_wire_float` convert float32 to and from the float dtypes.

Any violation raises :class:`WireError` with an :class:`~megatron_gkd.teacher.protocol.types.ErrorCode`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import struct
from typing import Any

import msgpack
import numpy as np

from megatron_gkd.teacher.protocol.types import ErrorCode, TeacherError

PROTOCOL_VERSION = 1
MAC_BYTES = 32

# Message types. A client sends SCORE, GENERATE or INFO; a worker answers RESULT, GENERATED,
# INFO_RESULT or ERROR. On every new connection the proxy sends a CHALLENGE (a fresh nonce): a client
# answers HELLO, a worker REGISTER (the nonce, signed), and only then may it send requests (client) or
# get them (worker).
SCORE, RESULT, INFO, INFO_RESULT, ERROR = "score", "result", "info", "info_result", "error"
GENERATE, GENERATED = "generate", "generated"
CHALLENGE, REGISTER, HELLO = "challenge", "register", "hello"
MESSAGE_TYPES = (SCORE, RESULT, INFO, INFO_RESULT, ERROR, CHALLENGE, REGISTER, HELLO, GENERATE, GENERATED)
REQUEST_TYPES = (SCORE, GENERATE, INFO)  # what a proven client may send, and the proxy queues for a worker
UNAUTHENTICATED_ID = "unauthenticated"  # the id of every refusal sent to an unauthenticated sender

# Little-endian only, so the bytes mean the same on every host. uint16 is not a dtype of its own on
# the wire: a uint16 array is the bit patterns of a bfloat16 tensor, and travels as "bfloat16".
BFLOAT16 = np.dtype("<u2")
DTYPES = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8"), "float32": np.dtype("<f4"),
          "float16": np.dtype("<f2"), "bfloat16": BFLOAT16}
FLOAT_DTYPES = ("bfloat16", "float16", "float32")  # what to_wire_float / from_wire_float convert


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``values``, rounded to nearest even as torch rounds.

    Keeping the upper 16 bits after adding ``0x7FFF`` plus the lowest kept bit rounds ties to even;
    a carry into the exponent rounds up to the next power of two, or to inf past bfloat16's max. NaN
    becomes torch's quiet NaN ``0x7FC0`` (the carry could otherwise turn a NaN into inf).
    """
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(values), np.uint32(0x7FC0), rounded).astype(BFLOAT16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bfloat16 is float32 with 16 fewer mantissa bits)."""
    return (np.asarray(bits, dtype=BFLOAT16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_wire_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` as the array :func:`encode` sends as ``dtype`` (one of :data:`FLOAT_DTYPES`)."""
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(values)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not a wire float dtype ({', '.join(FLOAT_DTYPES)})")
    with np.errstate(over="ignore"):  # float16 past 65504 becomes inf, which callers check for
        return np.asarray(values, dtype=np.float32).astype(DTYPES[dtype])


def wire_float_dtype(array: np.ndarray) -> str | None:
    """The wire float dtype a received array was sent as, or None for an integer array."""
    if array.dtype == BFLOAT16:
        return "bfloat16"
    return next((name for name in ("float16", "float32") if array.dtype == DTYPES[name]), None)


def from_wire_float(array: np.ndarray) -> np.ndarray:
    """A received float tensor (bfloat16 bits, float16 or float32) as float32, values unchanged."""
    dtype = wire_float_dtype(array)
    if dtype is None:
        raise ValueError(f"a {array.dtype} array is not a wire float tensor")
    return bfloat16_bits_to_float32(array) if dtype == "bfloat16" else array.astype(np.float32)


class WireError(TeacherError):
    """A received message violates the protocol; ``code`` says how.

    ``authenticated`` is True when the message's MAC was verified before the violation was found:
    only such a sender may get a signed refusal that names its request id.
    """

    authenticated = False


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """Bounds on received messages, checked before any buffer is decoded.

    Attributes:
        max_message_bytes: total bytes of all frames.
        max_header_bytes: bytes of the msgpack header frame.
        max_tensors: number of tensor buffers.
        max_tensor_dims: dimensions of one tensor.
    """

    max_message_bytes: int = 512 * 2**20
    max_header_bytes: int = 64 * 2**10
    max_tensors: int = 16
    max_tensor_dims: int = 3

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"Limits.{field.name} must be >= 1")


@dataclasses.dataclass(kw_only=True, slots=True)
class Message:
    """A decoded message: header fields plus named numpy arrays (read-only views of the frames)."""

    type: str
    request_id: str
    meta: dict[str, Any]
    tensors: dict[str, np.ndarray]


def _mac(secret: bytes, frames: list[bytes]) -> bytes:
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        # Length prefixes make the frame boundaries part of what is signed.
        digest.update(struct.pack("<Q", len(frame)))
        digest.update(frame)
    return digest.digest()


def encode(message_type: str, request_id: str, meta: dict[str, Any] | None = None,
           tensors: dict[str, np.ndarray] | None = None, secret: bytes | None = None) -> list[bytes]:
    """Returns the frames of one message (without the ZMQ routing envelope)."""
    assert message_type in MESSAGE_TYPES, message_type
    specs, buffers = [], []
    for name, array in (tensors or {}).items():
        dtype_name = next((k for k, v in DTYPES.items() if v == array.dtype.newbyteorder("<")), None)
        if dtype_name is None:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}; the wire allows {sorted(DTYPES)}")
        data = np.ascontiguousarray(array, dtype=DTYPES[dtype_name])
        specs.append({"name": name, "dtype": dtype_name, "shape": list(data.shape), "nbytes": data.nbytes})
        buffers.append(data.tobytes())
    header = msgpack.packb({"v": PROTOCOL_VERSION, "id": request_id, "type": message_type,
                            "tensors": specs, "meta": meta or {}}, use_bin_type=True)
    body = [header, *buffers]
    return [_mac(secret, body) if secret else b"", *body]


def error_frames(request_id: str, code: ErrorCode, message: str, secret: bytes | None) -> list[bytes]:
    """Frames of a typed error reply."""
    return encode(ERROR, request_id, {"code": ErrorCode(code).value, "message": message[:2000]},
                  secret=secret)


def refusal_frames(error: WireError, body: list[bytes], secret: bytes | None) -> list[bytes]:
    """The error reply to a message refused with ``error``.

    An authenticated sender gets a signed refusal naming its request. Anyone else gets an unsigned
    one under a fixed id: signing it would hand a stranger a validly signed message with content
    of its choosing (its request id) to replay at a real client.
    """
    if error.authenticated:
        return error_frames(peek_request_id(body) or "unknown", error.code, error.detail, secret)
    return error_frames(UNAUTHENTICATED_ID, error.code, error.detail, None)


def verify(frames: list[bytes], secret: bytes | None) -> None:
    """Checks the MAC frame; raises WireError(BAD_SIGNATURE) on a missing or wrong one."""
    if not frames:
        raise WireError(ErrorCode.BAD_FRAME, "empty message")
    mac, body = frames[0], frames[1:]
    if secret is None:
        if mac:
            raise WireError(ErrorCode.BAD_SIGNATURE, "message is signed but this peer has no secret")
        return
    if not hmac.compare_digest(mac, _mac(secret, body)):
        raise WireError(ErrorCode.BAD_SIGNATURE, "HMAC mismatch: wrong or missing shared secret")


def _require(condition: bool, code: ErrorCode, message: str) -> None:
    if not condition:
        raise WireError(code, message)


def _peek(frames: list[bytes], key: str):
    """Best-effort header field of a (possibly malformed, unverified) message; never raises."""
    try:
        header = msgpack.unpackb(frames[1], raw=False, max_str_len=2048, max_bin_len=0,
                                 max_array_len=64, max_map_len=64, max_ext_len=0)
        return header.get(key) if isinstance(header, dict) else None
    except Exception:  # noqa: BLE001 - any garbage just has no such field
        return None


def peek_request_id(frames: list[bytes]) -> str:
    """Best-effort request id of a (possibly malformed) message, for error replies; never raises."""
    request_id = _peek(frames, "id")
    return request_id if isinstance(request_id, str) and len(request_id) <= 64 else ""


def peek_type(frames: list[bytes]) -> str:
    """Best-effort message type of a (possibly malformed) message, for logs; never raises."""
    kind = _peek(frames, "type")
    return kind if kind in MESSAGE_TYPES else ""


def peek_meta(frames: list[bytes]) -> dict:
    """Best-effort meta map of a (possibly malformed, unverified) message, for logs; never raises."""
    meta = _peek(frames, "meta")
    return meta if isinstance(meta, dict) else {}


def decode(frames: list[bytes], limits: Limits, secret: bytes | None = None,
           expect: tuple[str, ...] = MESSAGE_TYPES) -> Message:
    """Verifies, parses and validates one message; raises WireError with a typed code."""
    total = sum(len(f) for f in frames)
    _require(total <= limits.max_message_bytes, ErrorCode.TOO_LARGE,
             f"message has {total} bytes, limit {limits.max_message_bytes}")
    _require(2 <= len(frames) <= limits.max_tensors + 2, ErrorCode.BAD_FRAME,
             f"message has {len(frames)} frames, expected 2..{limits.max_tensors + 2}")
    verify(frames, secret)
    try:
        return _decode_verified(frames, limits, expect)
    except WireError as error:
        error.authenticated = True
        raise


def _decode_verified(frames: list[bytes], limits: Limits, expect: tuple[str, ...]) -> Message:
    raw_header = frames[1]
    _require(len(raw_header) <= limits.max_header_bytes, ErrorCode.TOO_LARGE,
             f"header has {len(raw_header)} bytes, limit {limits.max_header_bytes}")
    try:
        # ext types are refused outright (max_ext_len=0): the header holds plain data only.
        header = msgpack.unpackb(raw_header, raw=False, strict_map_key=True, max_ext_len=0,
                                 max_bin_len=0, max_str_len=limits.max_header_bytes,
                                 max_array_len=limits.max_header_bytes,
                                 max_map_len=limits.max_header_bytes)
    except Exception as error:  # noqa: BLE001 - msgpack raises several unrelated types
        raise WireError(ErrorCode.BAD_FRAME, f"header is not valid msgpack ({type(error).__name__})") from None
    _require(isinstance(header, dict), ErrorCode.BAD_FRAME, "header is not a map")
    _require(header.get("v") == PROTOCOL_VERSION, ErrorCode.BAD_VERSION,
             f"protocol version {header.get('v')!r}, this peer speaks {PROTOCOL_VERSION}")
    _require(set(header) == {"v", "id", "type", "tensors", "meta"}, ErrorCode.BAD_FRAME,
             f"header keys {sorted(map(str, header))} != ['id', 'meta', 'tensors', 'type', 'v']")
    request_id, message_type, specs, meta = header["id"], header["type"], header["tensors"], header["meta"]
    _require(isinstance(request_id, str) and 0 < len(request_id) <= 64, ErrorCode.BAD_FRAME,
             "request id must be a string of 1-64 characters")
    _require(message_type in expect, ErrorCode.BAD_REQUEST,
             f"message type {message_type!r} not accepted here (expected one of {list(expect)})")
    _require(isinstance(meta, dict), ErrorCode.BAD_FRAME, "meta is not a map")
    _require(isinstance(specs, list) and len(specs) == len(frames) - 2, ErrorCode.BAD_FRAME,
             f"header lists {len(specs) if isinstance(specs, list) else '?'} tensors but "
             f"{len(frames) - 2} buffers follow")
    tensors = {}
    for spec, buffer in zip(specs, frames[2:]):
        name, array = _decode_tensor(spec, buffer, limits)
        _require(name not in tensors, ErrorCode.BAD_FRAME, f"tensor {name!r} appears twice")
        tensors[name] = array
    return Message(type=message_type, request_id=request_id, meta=meta, tensors=tensors)


def _decode_tensor(spec: Any, buffer: bytes, limits: Limits) -> tuple[str, np.ndarray]:
    _require(isinstance(spec, dict) and set(spec) == {"name", "dtype", "shape", "nbytes"},
             ErrorCode.BAD_FRAME, "tensor spec must be a map with name, dtype, shape, nbytes")
    name, dtype, shape, nbytes = spec["name"], spec["dtype"], spec["shape"], spec["nbytes"]
    _require(isinstance(name, str) and 0 < len(name) <= 64, ErrorCode.BAD_FRAME, "bad tensor name")
    _require(dtype in DTYPES, ErrorCode.BAD_FRAME,
             f"tensor {name!r} dtype {dtype!r} not in the allow-list {sorted(DTYPES)}")
    _require(isinstance(shape, list) and len(shape) <= limits.max_tensor_dims
             and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape),
             ErrorCode.BAD_FRAME, f"tensor {name!r} has a bad shape {shape!r}")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    _require(nbytes == expected == len(buffer), ErrorCode.BAD_FRAME,
             f"tensor {name!r}: shape {shape} of {dtype} needs {expected} bytes, header says "
             f"{nbytes}, buffer has {len(buffer)} (truncated?)")
    return name, np.frombuffer(buffer, dtype=DTYPES[dtype]).reshape(shape)
