"""The server side of ZMTP 3.0 (NULL mechanism), read from a ZMQ_STREAM socket as bytes arrive.

Why not a ROUTER socket: libzmq delivers a multipart message only once all its frames have arrived,
and ``MAXMSGSIZE`` bounds one frame, not a message, so a peer can make a ROUTER buffer any number of
frames just under the limit before the application sees the first one (a 168 MiB message against an
8 MiB limit grew a server by 574 MiB). A ZMQ_STREAM socket hands over the raw bytes in chunks of at
most 8 KiB instead; :class:`FrameReader` parses them and enforces the frame count and byte bounds
per message while the bytes come in, so an oversized message is refused at the frame header that
crosses a bound, before its body is read. A frame's resident memory grows with the bytes that arrive,
never to the size its header declares (a header is a claim any stranger can make for free): small
frames grow a bytearray, frames from :data:`MAPPED_FRAME_BYTES` on are written into an anonymous
mapping whose pages the kernel backs only once written, and which goes back to the system whole when
dropped. :meth:`FrameReader.release` drops a closed connection's partial message at once.

Peers are ordinary libzmq DEALER sockets (the ``zmq`` client and the workers); they see a ROUTER.
Spec: ZMTP 3.0 (rfc.zeromq.org/spec/23) with the NULL security mechanism (spec/24 READY command).
"""

from __future__ import annotations

import mmap
import struct
import time
from typing import Callable

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
GREETING_BYTES = 64
MAX_COMMAND_BYTES = 4096  # a READY with a socket type and an identity is ~50 bytes
_COALESCE_BYTES = 1 << 16  # frames below this are copied into one buffer for sending
_EMPTY = b""
MAPPED_FRAME_BYTES = 1 << 20  # frames from this size on are received into a mapping of their own
KEPT_FRAMES = 3  # a discarded message keeps its routing delimiter, MAC and header ...
MAX_KEPT_FRAME_BYTES = 64 * 2**10  # ... each when no larger than this


def _greeting(as_server: bool) -> bytes:
    # signature (0xFF, 8 bytes padding, 0x7F), version 3.0, mechanism, as-server, filler.
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes([as_server]) + bytes(31)


SERVER_GREETING = _greeting(True)


class ZmtpError(Exception):
    """The peer broke the protocol or a bound; the connection must be closed."""


class Discarded(list):
    """A complete message that was parsed but not held (:meth:`FrameReader.discard`): its first
    :data:`KEPT_FRAMES` frames when small (empty otherwise), so that its sender can be answered."""


def _frame_header(flags: int, size: int) -> bytes:
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | LONG]) + struct.pack(">Q", size)


def ready_command(socket_type: bytes) -> bytes:
    """The NULL mechanism's READY command announcing ``socket_type`` (e.g. ``b"ROUTER"``)."""
    name, key = b"READY", b"Socket-Type"
    body = bytes([len(name)]) + name + bytes([len(key)]) + key + struct.pack(">I", len(socket_type)) + socket_type
    return _frame_header(COMMAND, len(body)) + body


def encode(frames: list) -> list:
    """The bytes of one message, as a few buffers: small frames coalesced, large bodies as they are."""
    buffers, current = [], bytearray()
    for index, frame in enumerate(frames):
        size = len(frame)
        current += _frame_header(MORE if index < len(frames) - 1 else 0, size)
        if size < _COALESCE_BYTES:
            current += frame
        else:
            buffers += [bytes(current), frame]
            current = bytearray()
    if current:
        buffers.append(bytes(current))
    return buffers


def _parse_ready(body: memoryview, expect_socket_type: bytes) -> None:
    """Checks a READY command; the peer must announce ``expect_socket_type``."""
    data = bytes(body)
    name_size = data[0] if data else 0
    if data[1:1 + name_size] != b"READY":
        raise ZmtpError(f"expected the READY command, got {data[1:1 + name_size][:20]!r}")
    position, properties = 1 + name_size, {}
    while position < len(data):
        key_size = data[position]
        key = data[position + 1:position + 1 + key_size]
        position += 1 + key_size
        if position + 4 > len(data):
            raise ZmtpError("truncated READY property")
        (value_size,) = struct.unpack_from(">I", data, position)
        value = data[position + 4:position + 4 + value_size]
        if len(value) != value_size:
            raise ZmtpError("truncated READY property")
        properties[key.lower()] = value
        position += 4 + value_size
    if properties.get(b"socket-type") != expect_socket_type:
        raise ZmtpError(f"peer socket type {properties.get(b'socket-type')!r}, expected {expect_socket_type!r}")


class FrameReader:
    """Parses one connection's bytes into messages, within bounds checked at every frame header.

    Args:
        max_frames: frames per message.
        max_bytes: bytes per message (all frames).
        peer_socket_type: the socket type the peer must announce.
        clock: the time :attr:`message_started` records.
    """

    _GREETING, _FLAGS, _SIZE, _BODY, _CLOSED = range(5)

    def __init__(self, max_frames: int, max_bytes: int, peer_socket_type: bytes = b"DEALER",
                 clock: Callable[[], float] = time.monotonic):
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self._peer_socket_type = peer_socket_type
        self._clock = clock
        self._state, self._need = self._GREETING, GREETING_BYTES
        self._head = bytearray()
        self._flags = 0
        self._body: bytearray | mmap.mmap | None = None
        self._filled = 0  # bytes written into a mapped body
        self._declared_frame = 0  # size of the frame in progress
        self._discarding = False  # the message in progress is parsed, not held (see discard)
        self._remaining = 0  # bytes of the current frame's body still to come
        self._frames: list = []
        self._arrived = self._declared = 0  # body bytes of the message in progress
        self.greeted = False  # the peer's greeting was valid: our READY may go out
        self.ready = False  # the peer's READY arrived: messages may follow
        self.message_started: float | None = None  # when the first byte of the message in progress came

    @property
    def pending_bytes(self) -> int:
        """Body bytes held for the message in progress: what arrived, not what its headers declare."""
        return self._arrived

    @property
    def declared_bytes(self) -> int:
        """Body bytes the headers of the message in progress declare (its frames so far)."""
        return self._declared

    @property
    def num_pending_frames(self) -> int:
        """Frames of the message in progress, the one still arriving included."""
        return len(self._frames) + (self._state == self._BODY)

    def release(self) -> None:
        """Drops the message in progress and refuses more bytes: its connection is closed."""
        self._head, self._body, self._frames = bytearray(), None, []
        self._arrived = self._declared = 0
        self._discarding = False
        self.message_started = None
        self._state = self._CLOSED

    def discard(self) -> None:
        """Drops the message in progress except its first :data:`KEPT_FRAMES` small frames.

        The rest of it is still parsed (bounds included) but not held; once it is complete,
        :meth:`feed` returns it as :class:`Discarded`, so that its sender can be answered.
        """
        if self.message_started is None:
            return  # between messages: nothing is held, and the next message is not this one
        self._discarding = True
        self._frames = [frame if index < KEPT_FRAMES and len(frame) <= MAX_KEPT_FRAME_BYTES else _EMPTY
                        for index, frame in enumerate(self._frames)]
        if self._state == self._BODY and not self._keeps_frame_in_progress():
            self._body = None
        self._arrived = sum(len(frame) for frame in self._frames) + len(self._body or _EMPTY)

    def _keeps_frame_in_progress(self) -> bool:
        return (not self._discarding or self._flags & COMMAND
                or (len(self._frames) < KEPT_FRAMES and self._declared_frame <= MAX_KEPT_FRAME_BYTES))

    def feed(self, data) -> list[list]:
        """Consumes ``data`` (bytes-like); returns the messages it completed (lists of frames).

        Raises:
            ZmtpError: a protocol violation or a bound crossed; nothing more may be fed.
        """
        messages, _ = self._consume(data, stop_after_message=False)
        return messages

    def feed_one(self, data) -> tuple[list[list], int]:
        """Like :meth:`feed`, but stops once a message is complete: (messages, bytes consumed).

        For a connection whose bounds depend on what it says (a peer that has still to prove itself):
        the bytes after its first message are parsed only once the caller has set the bounds for them.
        """
        return self._consume(data, stop_after_message=True)

    def _consume(self, data, stop_after_message: bool) -> tuple[list[list], int]:
        if self._state == self._CLOSED:
            raise ZmtpError("the connection was closed")
        view, position, messages = memoryview(data), 0, []
        while position < len(view) and not (stop_after_message and messages):
            if self._state == self._BODY:
                take = min(self._remaining, len(view) - position)
                if isinstance(self._body, bytearray):
                    self._body += view[position:position + take]
                elif self._body is not None:
                    self._body[self._filled:self._filled + take] = view[position:position + take]
                    self._filled += take
                self._remaining -= take
                if not self._flags & COMMAND and self._body is not None:
                    self._arrived += take
                position += take
                if not self._remaining:
                    self._end_frame(self._body if self._body is not None else _EMPTY, messages)
                continue
            if self._state == self._FLAGS and self.ready and self.message_started is None:
                self.message_started = self._clock()
            take = min(self._need - len(self._head), len(view) - position)
            self._head += view[position:position + take]
            position += take
            if len(self._head) == self._need:
                head, self._head = bytes(self._head), bytearray()
                self._on_head(head, messages)
        return messages, position

    def _on_head(self, head: bytes, messages: list) -> None:
        if self._state == self._GREETING:
            if head[0] != 0xFF or head[9] != 0x7F or head[10] < 3:
                raise ZmtpError("not a ZMTP 3 greeting")
            if head[12:32] != b"NULL".ljust(20, b"\0"):
                raise ZmtpError(f"security mechanism {head[12:32].rstrip(bytes(1))!r}, only NULL is spoken")
            self.greeted = True
            self._state, self._need = self._FLAGS, 1
        elif self._state == self._FLAGS:
            self._flags = head[0]
            if self._flags & ~(MORE | LONG | COMMAND):
                raise ZmtpError(f"reserved frame flags {self._flags:#x}")
            self._state, self._need = self._SIZE, 8 if self._flags & LONG else 1
        else:
            size = struct.unpack(">Q", head)[0] if len(head) == 8 else head[0]
            self._start_frame(size, messages)

    def _start_frame(self, size: int, messages: list) -> None:
        if self._flags & COMMAND:
            if self.ready or self._flags & MORE or size > MAX_COMMAND_BYTES:
                raise ZmtpError("unexpected command frame")
        else:
            if not self.ready:
                raise ZmtpError("a message before the READY command")
            if len(self._frames) + 1 > self.max_frames:
                raise ZmtpError(f"more than {self.max_frames} frames in one message")
            if self._declared + size > self.max_bytes:
                raise ZmtpError(f"a message of more than {self.max_bytes} bytes (frame {len(self._frames)} "
                                f"declares {size})")
            self._declared += size
        self._declared_frame = size
        if size == 0:
            self._end_frame(_EMPTY, messages)
        elif not self._keeps_frame_in_progress():
            self._body, self._remaining, self._state = None, size, self._BODY  # parsed, not held
        elif size < MAPPED_FRAME_BYTES:
            # Grown as the bytes arrive (bytearray over-allocates geometrically, so appending 8 KiB
            # chunks copies little), so that memory follows what a peer sent, not what it declared.
            self._body, self._remaining, self._state = bytearray(), size, self._BODY
        else:
            # An anonymous mapping of the declared size: the kernel backs a page only when a byte
            # is written to it, so resident memory still follows what arrived, and the whole frame
            # goes back to the system when it is dropped. Growing a bytearray instead reallocates
            # through the heap, whose freed blocks glibc keeps: eight peers growing such frames at
            # once held about twice their bytes in RSS, and half of it after they were gone.
            self._body, self._remaining, self._state = mmap.mmap(-1, size), size, self._BODY
            self._filled = 0

    def _end_frame(self, body, messages: list) -> None:
        self._state, self._need, self._body = self._FLAGS, 1, None
        if self._flags & COMMAND:
            _parse_ready(memoryview(body), self._peer_socket_type)
            self.ready = True
            return
        self._frames.append(body)
        if not self._flags & MORE:
            messages.append(Discarded(self._frames) if self._discarding else self._frames)
            self._frames, self._arrived, self._declared, self._discarding = [], 0, 0, False
            self.message_started = None
