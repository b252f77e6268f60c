"""The proxy's ZMTP reader: messages out of any chunking, bounds enforced at the frame header."""

import re
import struct

import pytest

from megatron_gkd.teacher.protocol import zmtp

CLIENT_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32)


def _ready(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    body += b"\x08Identity" + struct.pack(">I", 0)
    return bytes([zmtp.COMMAND, len(body)]) + body


def _stream(*messages) -> bytes:
    return CLIENT_GREETING + _ready() + b"".join(b"".join(zmtp.encode(list(m))) for m in messages)


def _feed(reader, data: bytes, chunk: int):
    out = []
    for start in range(0, len(data), chunk):
        out += reader.feed(data[start:start + chunk])
    return out


@pytest.mark.parametrize("chunk", [1, 7, 8192])
def test_messages_survive_any_chunking(chunk):
    messages = [[b"", b"mac", b"header"], [b"", b"x" * 300, b"y" * 70000, b""], [b"single"]]
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**20)
    got = _feed(reader, _stream(*messages), chunk)
    assert [[bytes(f) for f in m] for m in got] == messages
    assert reader.greeted and reader.ready and reader.pending_bytes == 0


def test_too_many_frames_are_refused_at_the_header_that_crosses_the_bound():
    reader = zmtp.FrameReader(max_frames=4, max_bytes=2**20)
    reader.feed(CLIENT_GREETING + _ready())
    frames = b"".join(bytes([zmtp.MORE, 1]) + b"a" for _ in range(4))
    reader.feed(frames)
    with pytest.raises(zmtp.ZmtpError, match="more than 4 frames"):
        reader.feed(bytes([zmtp.MORE, 1]))  # the fifth frame's header alone


def test_an_oversized_frame_is_refused_before_its_body_arrives():
    reader = zmtp.FrameReader(max_frames=8, max_bytes=1000)
    reader.feed(CLIENT_GREETING + _ready() + bytes([zmtp.MORE, 200]) + b"a" * 200)
    assert reader.pending_bytes == 200
    with pytest.raises(zmtp.ZmtpError, match="more than 1000 bytes"):
        reader.feed(bytes([zmtp.LONG]) + struct.pack(">Q", 2**62))  # declares 4 EiB, sends none


@pytest.mark.parametrize("data, match", [
    (b"GET / HTTP/1.1\r\n" + bytes(48), "greeting"),
    (CLIENT_GREETING[:12] + b"CURVE".ljust(20, b"\0") + bytes(32), "mechanism"),
    (CLIENT_GREETING + _ready(b"ROUTER"), "socket type"),
    (CLIENT_GREETING + bytes([0, 1]) + b"a", "before the READY"),
    (CLIENT_GREETING + _ready() + _ready(), "unexpected command"),
    (CLIENT_GREETING + _ready() + bytes([0x80, 1]) + b"a", "reserved"),
    (CLIENT_GREETING + bytes([zmtp.COMMAND | zmtp.LONG]) + struct.pack(">Q", 10**6), "unexpected command"),
])
def test_protocol_violations_end_the_connection(data, match):
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**20)
    with pytest.raises(zmtp.ZmtpError, match=match):
        reader.feed(data)


def test_a_declared_frame_reserves_only_the_bytes_that_arrived():
    # A stranger's header declaring a frame just under the limit, plus one byte of it: 12 bytes
    # that once reserved the whole declared size against the proxy's shared byte budget.
    now = [100.0]
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**20, clock=lambda: now[0])
    reader.feed(CLIENT_GREETING + _ready())
    assert reader.pending_bytes == 0 and reader.message_started is None  # idle between messages
    reader.feed(bytes([zmtp.MORE, 0]) + bytes([zmtp.LONG]) + struct.pack(">Q", 2**20 - 1) + b"a")
    assert reader.pending_bytes == 1
    assert reader.declared_bytes == 2**20 - 1
    assert reader.message_started == 100.0
    now[0] = 105.0
    [message] = reader.feed(b"b" * (2**20 - 2))
    assert [bytes(f) for f in message] == [b"", b"a" + b"b" * (2**20 - 2)]
    assert reader.pending_bytes == 0 and reader.declared_bytes == 0 and reader.message_started is None


def test_the_next_message_starts_its_own_clock():
    now = [0.0]
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**20, clock=lambda: now[0])
    reader.feed(CLIENT_GREETING + _ready() + bytes([0, 1]) + b"x")  # one complete message at t=0
    now[0] = 50.0
    # the end of nothing and the start of the next message arrive in one chunk, at t=50
    assert reader.feed(bytes([zmtp.MORE, 1]) + b"y") == []
    assert reader.message_started == 50.0 and reader.pending_bytes == 1


def _resident_of_mappings_sized(size: int) -> list[int]:
    """Resident bytes of each mapping of exactly ``size`` bytes in this process.

    Read per mapping rather than for the whole process: in a long suite other threads and the
    allocator's own state move the process RSS by megabytes between two reads."""
    resident, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = end - start
            elif head[0] == "Rss:" and current == size:
                resident.append(int(head[1]) * 1024)
    return resident


@pytest.mark.parametrize("chunk", [8192, 65537])
def test_mapped_frames_survive_any_chunking(chunk):
    big = bytes(range(256)) * (3 * 2**20 // 256 + 1)  # over MAPPED_FRAME_BYTES: received into a mapping
    messages = [[b"", b"mac", big, b"tail"], [b"", big[:zmtp.MAPPED_FRAME_BYTES]]]
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**23)
    got = _feed(reader, _stream(*messages), chunk)
    assert [[bytes(f) for f in m] for m in got] == messages
    assert reader.pending_bytes == 0


def test_a_large_declared_frame_is_resident_only_as_far_as_it_arrived_and_released_at_once():
    declared = 2**29
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**30)
    reader.feed(CLIENT_GREETING + _ready())
    assert _resident_of_mappings_sized(declared) == []
    reader.feed(bytes([zmtp.MORE, 0]) + bytes([zmtp.LONG]) + struct.pack(">Q", declared) + b"a" * 2**20)
    assert reader.pending_bytes == 2**20
    [held] = _resident_of_mappings_sized(declared)
    assert 2**20 <= held < 2 * 2**20, f"a 512 MiB frame with 1 MiB arrived holds {held / 2**20:.1f} MiB"
    reader.feed(b"b" * 2**24)
    [held] = _resident_of_mappings_sized(declared)
    assert 17 * 2**20 <= held < 18 * 2**20  # the bytes that arrived are held, as counted
    reader.release()
    assert reader.pending_bytes == 0 and reader.message_started is None
    assert _resident_of_mappings_sized(declared) == [], "the released frame's mapping was not given back"
    with pytest.raises(zmtp.ZmtpError, match="closed"):
        reader.feed(b"c")


def test_feed_one_stops_after_a_message_so_the_next_bytes_meet_new_bounds():
    # A peer that proves itself in its first message and sends a large one right behind it: the
    # second is parsed only after the caller raised the bounds the first one earned.
    big = [b"", b"x" * 5000]
    data = _stream([b"", b"hello"], big)
    reader = zmtp.FrameReader(max_frames=4, max_bytes=4096)
    messages, used = reader.feed_one(data)
    assert [[bytes(f) for f in m] for m in messages] == [[b"", b"hello"]]
    reader.max_bytes = 2**20
    assert [[bytes(f) for f in m] for m in reader.feed(data[used:])] == [big]
    with pytest.raises(zmtp.ZmtpError, match="more than 4096 bytes"):  # all at once: refused
        zmtp.FrameReader(max_frames=4, max_bytes=4096).feed(data)


@pytest.mark.parametrize("cut", [3, 40, 3000, 2**21])
def test_a_discarded_message_keeps_only_its_small_head_and_is_returned_as_such(cut):
    head = [b"", b"m" * 32, b"h" * 200]
    message = head + [b"a" * 2**21, b"b" * 100]
    data = _stream(message, [b"", b"next"])
    prefix = len(_stream())
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**23)
    assert reader.feed(data[:prefix + cut]) == []
    reader.discard()
    assert reader.pending_bytes <= sum(map(len, head))
    got = _feed(reader, data[prefix + cut:], 8192)
    assert isinstance(got[0], zmtp.Discarded) and not isinstance(got[1], zmtp.Discarded)
    kept = [bytes(f) for f in got[0]]
    assert len(kept) == len(message) and kept[3:] == [b"", b""]
    assert all(frame in (original, b"") for frame, original in zip(kept, head))
    if cut > sum(map(len, head)) + 20:  # the head had arrived whole: it is kept whole
        assert kept[:3] == head
    assert [bytes(f) for f in got[1]] == [b"", b"next"] and reader.pending_bytes == 0


def test_discard_between_messages_does_nothing():
    reader = zmtp.FrameReader(max_frames=8, max_bytes=2**20)
    reader.feed(_stream([b"", b"one"]))
    reader.discard()
    [message] = reader.feed(b"".join(zmtp.encode([b"", b"two"])))
    assert not isinstance(message, zmtp.Discarded) and [bytes(f) for f in message] == [b"", b"two"]
