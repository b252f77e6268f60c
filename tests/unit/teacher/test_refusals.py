"""Refusals: unauthenticated senders get nothing signed, and a flood of them is not a flood of logs."""

import logging

import msgpack
import pytest
import zmq

from megatron_gkd.teacher import ScoreBatch, SequenceRequest
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import ErrorCode
from tests.unit.teacher.conftest import LIMITS, SECRET

ATTACKER_ID = "attacker-chosen-id"


def _unsigned(frames):
    return [b"", *frames[1:]]


def _with_id(frames, request_id):
    header = msgpack.unpackb(frames[1])
    header["id"] = request_id
    return [frames[0], msgpack.packb(header), *frames[2:]]


def _unauthenticated_messages():
    good = codec.encode_request("x", ScoreBatch(sequences=[SequenceRequest(token_ids=[5, 6, 7], response_start=1)],
                                                top_k=2), SECRET)
    good = _with_id(good, ATTACKER_ID)
    yield "too many frames", _unsigned(good) + [b"\0" * 8] * (LIMITS.max_tensors + 2)
    yield "wrong mac", [b"\1" * 32, *good[1:]]
    yield "no mac", _unsigned(good)
    yield "too large", _unsigned(good)[:2] + [b"\0" * (LIMITS.max_message_bytes - 100)] * 2


@pytest.fixture()
def attacker(service):
    proxy, _ = service
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(proxy.frontend_address)
    yield socket
    socket.close()


def test_unauthenticated_senders_get_no_signed_reply_and_no_echo_of_their_id(attacker):
    for what, frames in _unauthenticated_messages():
        attacker.send_multipart([b"", *frames])
        while attacker.poll(1000):
            reply = attacker.recv_multipart()
            if wire.peek_type(reply[1:]) == wire.CHALLENGE:
                # The one signed message a stranger gets: the proxy's own, with nothing of the
                # stranger's choosing in it (a fixed id and a fresh random nonce).
                challenge = wire.decode(reply[1:], LIMITS, SECRET, expect=(wire.CHALLENGE,))
                assert challenge.request_id == "challenge" and set(challenge.meta) == {"nonce"}
                assert challenge.tensors == {}
                continue
            with pytest.raises(wire.WireError):  # nothing else an attacker gets can pass as signed
                wire.decode(reply[1:], LIMITS, SECRET)
            message = wire.decode(reply[1:], LIMITS, None, expect=(wire.ERROR,))
            assert message.request_id != ATTACKER_ID, f"{what}: the refusal echoes the sender's id"
            assert ErrorCode(message.meta["code"]) in (ErrorCode.BAD_SIGNATURE, ErrorCode.BAD_FRAME,
                                                       ErrorCode.TOO_LARGE)


def test_a_flood_of_refusals_is_logged_rate_limited(attacker, caplog):
    messages = [frames for _, frames in _unauthenticated_messages()][1:3]
    with caplog.at_level(logging.INFO, logger="megatron_gkd"):
        for index in range(300):
            attacker.send_multipart([b"", *messages[index % 2]])
        while attacker.poll(1000):
            attacker.recv_multipart()
    lines = [r for r in caplog.records if r.name.startswith("megatron_gkd.teacher")]
    assert 1 <= len(lines) <= 25, f"{len(lines)} log lines for 300 refusals"
