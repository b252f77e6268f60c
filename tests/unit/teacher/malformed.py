"""Malformed teacher messages for the fuzz tests (in-process and against real processes).

Each message says whether it carries a valid MAC (only such a sender gets a signed refusal naming
its request) and, when its header survives, the refusal code it must get.
"""

import dataclasses
import pickle

import msgpack
import numpy as np

from megatron_gkd.teacher.protocol import wire
from megatron_gkd.teacher.protocol.types import ErrorCode


class CreatesFile:
    """Unpickling this object calls ``open(path, "w")``: proof of an unpickle is the file's existence."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_payload(marker) -> bytes:
    """Pickle bytes whose unpickling would create ``marker``."""
    return pickle.dumps(CreatesFile(marker))


def sign(body: list[bytes], secret: bytes) -> list[bytes]:
    return [wire._mac(secret, body), *body]


def with_header(good: list[bytes], secret: bytes, **changes) -> list[bytes]:
    """``good`` with header fields replaced, signed again."""
    header = msgpack.unpackb(good[1])
    header.update(changes)
    return sign([msgpack.packb(header), *good[2:]], secret)


@dataclasses.dataclass(kw_only=True)
class Malformed:
    frames: list | None  # None: an oversized message, sent on a connection of its own
    signed: bool
    request_id: str | None = None  # set when the refusal must name it
    code: ErrorCode | None = None  # the refusal it must get, when known


NUM_BASIC_KINDS = 9


def basic(index: int, rng: np.random.Generator, payload: bytes, good: list[bytes],
          secret: bytes) -> Malformed:
    """Malformed message number ``index`` of the wire-level kinds; ``good`` is a signed request."""
    header = msgpack.unpackb(good[1])
    request_id = f"m{index}"
    good = with_header(good, secret, id=request_id)
    kind = index % NUM_BASIC_KINDS
    if kind == 0:  # random bytes
        return Malformed(frames=[rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 5)))],
                         signed=False)
    if kind == 1:  # wrong protocol version, correctly signed
        return Malformed(frames=with_header(good, secret, v=int(rng.integers(2, 99))), signed=True,
                         request_id=request_id, code=ErrorCode.BAD_VERSION)
    if kind == 2:  # truncated buffer, correctly signed
        cut = int(rng.integers(1, len(good[2])))
        return Malformed(frames=sign([good[1], good[2][:cut], *good[3:]], secret), signed=True,
                         request_id=request_id, code=ErrorCode.BAD_FRAME)
    if kind == 3:  # pickle payload as header, signed and unsigned
        if index % 2:
            return Malformed(frames=sign([payload, *good[2:]], secret), signed=True, code=ErrorCode.BAD_FRAME)
        return Malformed(frames=[b"", payload, *good[2:]], signed=False)
    if kind == 4:  # pickle payload as a tensor buffer declared as bytes of a valid dtype
        return Malformed(frames=sign([good[1], payload, *good[3:]], secret), signed=True,
                         request_id=request_id, code=ErrorCode.BAD_FRAME)
    if kind == 5:  # wrong HMAC
        return Malformed(frames=[rng.bytes(32), *good[1:]], signed=False)
    if kind == 6:  # valid msgpack, broken schema
        tensors = [dict(t, shape=[-1]) for t in header["tensors"]]
        return Malformed(frames=with_header(good, secret, tensors=tensors), signed=True,
                         request_id=request_id, code=ErrorCode.BAD_FRAME)
    if kind == 7:  # a header claiming a huge tensor
        tensors = [dict(t, shape=[2**39], nbytes=2**42) for t in header["tensors"]]
        return Malformed(frames=with_header(good, secret, tensors=tensors), signed=True,
                         request_id=request_id, code=ErrorCode.BAD_FRAME)
    return Malformed(frames=None, signed=False)  # kind 8: oversize, on its own connection
