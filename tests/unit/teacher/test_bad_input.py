"""1,000 malformed messages against a live worker: typed errors or drops, never a crash or an unpickle."""

import os
import pathlib
import pickle

import msgpack
import numpy as np
import pytest
import zmq

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client, codec, wire
from megatron_gkd.teacher.types import ErrorCode
from tests.unit.teacher.conftest import LIMITS, SECRET

NUM_MALFORMED = 1000


class _CreatesFile:
    """Unpickling this object calls ``open(path, "w")``: proof of an unpickle is the file's existence."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _sign(body):
    return [wire._mac(SECRET, body), *body]


def _malformed(index: int, rng: np.random.Generator, payload: bytes, good: list[bytes]):
    """(frames, expects_reply) of malformed message number ``index``; cycles through the kinds."""
    header = msgpack.unpackb(good[1])
    kind = index % 9
    if kind == 0:  # random bytes
        return [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 5)))], True
    if kind == 1:  # wrong protocol version, correctly signed
        return _sign([msgpack.packb(dict(header, v=int(rng.integers(2, 99)))), *good[2:]]), True
    if kind == 2:  # truncated buffer, correctly signed
        cut = int(rng.integers(1, len(good[2])))
        return _sign([good[1], good[2][:cut], *good[3:]]), True
    if kind == 3:  # pickle payload as header, signed and unsigned
        return (_sign([payload, *good[2:]]) if index % 2 else [b"", payload, *good[2:]]), True
    if kind == 4:  # pickle payload as a tensor buffer declared as bytes of a valid dtype
        return _sign([good[1], payload, *good[3:]]), True
    if kind == 5:  # wrong HMAC
        return [rng.bytes(32), *good[1:]], True
    if kind == 6:  # valid msgpack, broken schema
        bad = dict(header, tensors=[dict(t, shape=[-1]) for t in header["tensors"]])
        return _sign([msgpack.packb(bad), *good[2:]]), True
    if kind == 7:  # a header claiming a huge tensor
        bad = dict(header, tensors=[dict(t, shape=[2**39], nbytes=2**42) for t in header["tensors"]])
        return _sign([msgpack.packb(bad), *good[2:]]), True
    return None, False  # kind 8: oversize, sent on its own connection (ZMQ drops that peer)


def _drain(socket, replies):
    while socket.poll(200, zmq.POLLIN):
        replies.append(socket.recv_multipart())


def test_malformed_frames_are_refused_and_nothing_is_unpickled(service, tmp_path):
    proxy, worker = service
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_CreatesFile(marker))
    armed = tmp_path / "armed"
    pickle.loads(pickle.dumps(_CreatesFile(armed)))  # the payload kind really does create its file
    assert armed.exists()

    rng = np.random.default_rng(0)
    good_batch = ScoreBatch(sequences=[SequenceRequest(token_ids=[5, 6, 7, 8], response_start=2)], top_k=4)
    good = codec.encode_request("fuzz", good_batch, SECRET)
    context = zmq.Context.instance()
    fuzz = context.socket(zmq.DEALER)
    fuzz.setsockopt(zmq.LINGER, 0)
    fuzz.connect(proxy.frontend_address)
    client = build_client("zmq", address=proxy.frontend_address, secret=SECRET,
                          retry=RetryPolicy(attempt_timeout_s=20, deadline_s=40))
    expected_replies, replies, oversize = 0, [], 0
    answered_before = worker.num_answered
    try:
        reference = client.score(good_batch)[0]
        for index in range(NUM_MALFORMED):
            frames, expects_reply = _malformed(index, rng, payload, good)
            if frames is None:
                oversize += 1
                big = context.socket(zmq.DEALER)
                big.setsockopt(zmq.LINGER, 0)
                big.connect(proxy.frontend_address)
                big.send_multipart([b"", b"", b"\0" * (LIMITS.max_message_bytes + 1)])
                big.close()
            else:
                fuzz.send_multipart([b"", *frames])
                expected_replies += expects_reply
            if index % 100 == 99:  # the server keeps serving correct requests in between
                output = client.score(good_batch)[0]
                np.testing.assert_array_equal(output.topk_ids, reference.topk_ids)
                np.testing.assert_array_equal(output.topk_logprobs, reference.topk_logprobs)
                _drain(fuzz, replies)
        _drain(fuzz, replies)
    finally:
        client.close()
        fuzz.close()

    assert len(replies) == expected_replies  # every attributable malformed message got an answer
    codes = set()
    for reply in replies:
        assert reply[0] == b""
        try:
            message = wire.decode(reply[1:], LIMITS, SECRET, expect=(wire.ERROR,))
        except wire.WireError as error:  # refusals of bad signatures come unsigned
            assert error.code == ErrorCode.BAD_SIGNATURE
            message = wire.decode(reply[1:], LIMITS, None, expect=(wire.ERROR,))
        codes.add(ErrorCode(message.meta["code"]))
    assert {ErrorCode.BAD_FRAME, ErrorCode.BAD_VERSION, ErrorCode.BAD_SIGNATURE} <= codes
    assert codes <= {ErrorCode.BAD_FRAME, ErrorCode.BAD_VERSION, ErrorCode.BAD_SIGNATURE,
                     ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST}
    assert oversize > 100
    # Oversize frames never reach the worker (ZMQ's MAXMSGSIZE drops the connection at the proxy).
    assert worker.num_answered - answered_before == expected_replies + NUM_MALFORMED // 100 + 1
    assert not marker.exists(), "a received payload was unpickled"


def test_no_pickle_or_torch_load_in_the_teacher_package():
    package = pathlib.Path(__file__).resolve().parents[3] / "megatron_gkd" / "teacher"
    for path in package.rglob("*.py"):
        text = path.read_text()
        for banned in ("import pickle", "pickle.load", "torch.load(", "cloudpickle", "allow_pickle=True"):
            assert banned not in text, f"{path.name} uses {banned}"
    assert os.path.isdir(package)
