"""1,000 malformed messages against a live proxy and worker: typed refusals, never a crash or an unpickle."""

import os
import pathlib
import pickle

import numpy as np
import zmq

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.types import ErrorCode
from megatron_gkd.teacher.service.proxy import MAX_UNSIGNED_REFUSALS
from tests.unit.teacher import malformed, peers
from tests.unit.teacher.conftest import LIMITS, SECRET

NUM_MALFORMED = 1000


def _drain(socket, replies):
    while socket.poll(200, zmq.POLLIN):
        replies.append(socket.recv_multipart())


def test_malformed_frames_are_refused_and_nothing_is_unpickled(service, tmp_path):
    proxy, worker = service
    marker = tmp_path / "unpickled"
    payload = malformed.pickle_payload(marker)
    armed = tmp_path / "armed"
    pickle.loads(malformed.pickle_payload(armed))  # the payload kind really does create its file
    assert armed.exists()

    rng = np.random.default_rng(0)
    good_batch = ScoreBatch(sequences=[SequenceRequest(token_ids=[5, 6, 7, 8], response_start=2)], top_k=4)
    good = codec.encode_request("fuzz", good_batch, SECRET)
    context = zmq.Context.instance()
    fuzz = peers.proven_dealer(proxy.frontend_address, SECRET)  # a peer with the secret, sending junk
    client = build_client("zmq", address=proxy.frontend_address, secret=SECRET,
                          retry=RetryPolicy(attempt_timeout_s=20, deadline_s=40))
    signed_sent = unsigned_sent = oversize = 0
    replies, expected = [], {}
    answered_before = worker.num_answered
    try:
        reference = client.score(good_batch)[0]
        for index in range(NUM_MALFORMED):
            message = malformed.basic(index, rng, payload, good, SECRET)
            frames, signed = message.frames, message.signed
            if message.request_id is not None:
                expected[message.request_id] = message.code
            if frames is None:
                oversize += 1
                big = context.socket(zmq.DEALER)
                big.setsockopt(zmq.LINGER, 0)
                big.connect(proxy.frontend_address)
                big.send_multipart([b"", b"", b"\0" * (LIMITS.max_message_bytes + 1)])
                big.close()
            else:
                fuzz.send_multipart([b"", *frames])
                signed_sent += signed
                unsigned_sent += not signed
            if index % 100 == 99:  # the server keeps serving correct requests in between
                output = client.score(good_batch)[0]
                np.testing.assert_array_equal(output.topk_ids, reference.topk_ids)
                np.testing.assert_array_equal(output.topk_logprobs, reference.topk_logprobs)
                _drain(fuzz, replies)
        _drain(fuzz, replies)
    finally:
        client.close()
        fuzz.close()

    codes, num_signed, num_unsigned = set(), 0, 0
    for reply in replies:
        assert reply[0] == b""
        try:
            message = wire.decode(reply[1:], LIMITS, SECRET, expect=(wire.ERROR,))
            num_signed += 1
            if message.request_id in expected:  # its header survived: the refusal names it
                assert ErrorCode(message.meta["code"]) == expected.pop(message.request_id)
            else:
                assert message.request_id == "unknown"  # a signed message whose header is garbage
        except wire.WireError as error:  # refusals of unauthenticated messages come unsigned
            assert error.code == ErrorCode.BAD_SIGNATURE
            message = wire.decode(reply[1:], LIMITS, None, expect=(wire.ERROR,))
            assert message.request_id == wire.UNAUTHENTICATED_ID
            num_unsigned += 1
        codes.add(ErrorCode(message.meta["code"]))
    # Every signed malformed message got a signed typed refusal; strangers got a few unsigned ones.
    assert num_signed == signed_sent
    assert not expected, f"no named refusal for {sorted(expected)[:5]}"
    assert num_unsigned == min(unsigned_sent, MAX_UNSIGNED_REFUSALS)
    assert {ErrorCode.BAD_FRAME, ErrorCode.BAD_VERSION, ErrorCode.BAD_SIGNATURE} <= codes
    assert codes <= {ErrorCode.BAD_FRAME, ErrorCode.BAD_VERSION, ErrorCode.BAD_SIGNATURE,
                     ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST}
    assert oversize > 100
    # Nothing malformed reaches the worker: the proxy refuses it (oversize messages before they
    # are even read). The worker answered the valid requests only.
    assert worker.num_answered - answered_before == NUM_MALFORMED // 100 + 1
    assert not marker.exists(), "a received payload was unpickled"


def test_no_pickle_or_torch_load_in_the_teacher_package():
    package = pathlib.Path(__file__).resolve().parents[3] / "megatron_gkd" / "teacher"
    for path in package.rglob("*.py"):
        text = path.read_text()
        for banned in ("import pickle", "pickle.load", "torch.load(", "cloudpickle", "allow_pickle=True"):
            assert banned not in text, f"{path.name} uses {banned}"
    assert os.path.isdir(package)
