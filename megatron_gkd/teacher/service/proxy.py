"""The teacher proxy: clients on one side, authenticated workers on the other, bounded memory.

Both sides are ZMQ_STREAM sockets whose bytes :class:`~megatron_gkd.teacher.protocol.zmtp.FrameReader`
parses as they arrive (see zmtp.py for why not ROUTER): a message over the frame or byte bounds is
refused at the frame header that crosses them and its connection closed, so no more of it is read.

Every new connection, on either side, gets a CHALLENGE (a fresh nonce) and must prove that it holds
the shared secret by answering it, signed: a client with HELLO, a worker with REGISTER. Until then it
may send :data:`UNPROVEN_BYTES` at once, holds none of the pending budget, is closed when it has not
answered within ``verification_timeout_s`` (clients) or ``registration_timeout_s`` (workers), and
is the first to go when :data:`max_unproven_connections` strangers are open on its side or the side
is full: a stranger spending bandwidth, or only sockets, can neither hold the memory nor take the
connections that signed calls need, and a recorded answer is useless on another connection.

A proven client's messages are verified (HMAC) and checked (wire header) here, and only authenticated,
well-formed requests are queued for a worker. Unauthenticated messages get at most
:data:`MAX_UNSIGNED_REFUSALS` unsigned refusals per connection; every refusal is logged rate-limited.
An unfinished message holds only the bytes that arrived against the pending budget, and is cut when
it is not complete ``message_timeout_s`` after its first byte. A proven client's message that would
take the pending budget past its bound is read to its end without being held and answered "busy"
(signed ``unavailable``), which its client retries after a pause.

Each registered worker holds one request at a time; requests wait in a bounded queue and go to
whichever worker is idle first, so several workers are data-parallel replicas: a slow one holds only
the request it has, and a dead one's request is reported to its client (signed ``backend_failed``),
which retries it on another.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import secrets
import shutil
import tempfile
import threading
import time

import zmq

from megatron_gkd.teacher.protocol import identity, wire, zmtp
from megatron_gkd.teacher.protocol.security import RefusalLog, check_exposure
from megatron_gkd.teacher.protocol.types import ErrorCode

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the loop looks at its stop flag and timeouts
MAX_UNSIGNED_REFUSALS = 16  # per connection: enough for a misconfigured client to learn why
UNPROVEN_BYTES = 4096  # bound on what a connection that has not answered its challenge may send at once
_HELLO_ATTEMPTS = 3  # refused answers to a challenge before the connection is closed
_CHUNKS_PER_TURN = 512  # chunks read from one side before the other side gets a turn
_CLOSED_MEMORY = 4096  # identities closed here, remembered to ignore their late notifications
_ROUTE = b"proxy"  # envelope of the proxy's own messages to a worker


@dataclasses.dataclass(kw_only=True, slots=True)
class _Request:
    client: bytes  # identity of the client's connection
    request_id: str
    body: list  # [mac, header, *buffers]
    nbytes: int
    kind: str = ""  # the message type (wire.SCORE, wire.INFO, ...)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Connection:
    identity: bytes
    reader: zmtp.FrameReader
    opened: float
    ready_sent: bool = False
    refusals: int = 0  # unsigned refusals sent (clients), refused answers to the challenge (both)
    nonce: str = ""  # the challenge this connection must answer
    proven: bool = False  # answered its challenge: a client said HELLO, a worker registered
    busy: _Request | None = None
    info: dict | None = None  # the INFO a worker registered with: every INFO it answers must equal it


@dataclasses.dataclass(kw_only=True, slots=True)
class _Side:
    name: str
    socket: zmq.Socket
    envelope: list  # frames before a message the proxy sends on this side
    answer: str  # the message type that answers a challenge on this side
    connections: dict = dataclasses.field(default_factory=dict)
    # Identities of the connections that have not answered their challenge, oldest first.
    unproven: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)


def _stream_socket(context: zmq.Context, address: str) -> tuple[zmq.Socket, str]:
    socket = context.socket(zmq.STREAM)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 256)  # chunks of <= 8 KiB queued per connection inside libzmq
    # Unlimited, so a reply split over several STREAM messages is never cut midway by a full queue.
    # Only authenticated clients get more than a few small refusals.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.bind(address)
    return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)


class Proxy:
    """Forwards authenticated requests from clients to registered workers, in a thread.

    Args:
        frontend: address clients connect to (``tcp://127.0.0.1:0`` picks a free port).
        backend: address workers connect to; default: an IPC socket in a fresh directory only this
            user can enter.
        secret: shared secret; required for non-loopback addresses unless ``insecure``.
        insecure: allow non-loopback addresses without a secret (logs a warning).
        limits: size limits of messages.
        max_pending_bytes: bytes held for proven clients' unfinished messages and queued requests
            together (default: twice ``limits.max_message_bytes``); a message or request that would
            pass it is refused as ``unavailable`` (busy).
        max_queued_requests: requests waiting for a worker.
        max_connections: open connections per side.
        max_unproven_connections: open connections per side that have not answered their challenge;
            the oldest of them is closed when a new one comes (at most ``UNPROVEN_BYTES`` each).
        handshake_timeout_s: time a new connection has to complete the ZMTP handshake.
        verification_timeout_s: time a new client connection has to answer its challenge.
        registration_timeout_s: time a new worker connection has to register.
        message_timeout_s: time a client message has from its first byte to its last; a message
            still unfinished then is cut (its connection closed, what was cut logged). Idle
            connections between messages are not affected.
    """

    def __init__(self, frontend: str, backend: str | None = None, secret: bytes | None = None,
                 insecure: bool = False, limits: wire.Limits = wire.Limits(), *,  # noqa: B008 - frozen
                 max_pending_bytes: int | None = None, max_queued_requests: int = 1024,
                 max_connections: int = 4096, max_unproven_connections: int = 256,
                 handshake_timeout_s: float = 10.0, verification_timeout_s: float = 5.0,
                 registration_timeout_s: float = 30.0, message_timeout_s: float = 30.0):
        for name, value in (("message_timeout_s", message_timeout_s), ("verification_timeout_s",
                            verification_timeout_s), ("max_unproven_connections", max_unproven_connections)):
            if value <= 0:
                raise ValueError(f"Proxy {name}={value} must be > 0")
        self._private_dir = None
        if backend is None:
            self._private_dir = tempfile.mkdtemp(prefix="megatron-gkd-teacher-")  # mode 0700
            backend = f"ipc://{self._private_dir}/workers"
        for address in (frontend, backend):
            check_exposure(address, secret, insecure)
        self._secret, self._limits = secret, limits
        self._max_pending = max_pending_bytes or 2 * limits.max_message_bytes
        self._max_queued, self._max_connections = max_queued_requests, max_connections
        self._max_unproven = min(max_unproven_connections, max_connections)
        self._handshake_s, self._registration_s = handshake_timeout_s, registration_timeout_s
        self._verification_s = verification_timeout_s
        self._message_s = message_timeout_s
        context = zmq.Context.instance()
        front, self.frontend_address = _stream_socket(context, frontend)
        back, self.backend_address = _stream_socket(context, backend)
        self._front = _Side(name="client", socket=front, envelope=[b""], answer=wire.HELLO)
        self._back = _Side(name="worker", socket=back, envelope=[_ROUTE, b""], answer=wire.REGISTER)
        self._queue: collections.deque[_Request] = collections.deque()
        self._idle: collections.deque[bytes] = collections.deque()
        self._partial_bytes = self._queued_bytes = 0
        self._closed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._scratch = bytearray(1 << 16)  # libzmq hands STREAM data over in chunks of <= 8 KiB
        self._refusals = RefusalLog(logger, "messages")
        self._no_worker_warned = -float("inf")  # when the last "no worker" warning was logged
        self._num_registered = 0  # an int, so other threads can read it while the loop runs
        self._teacher: dict | None = None  # the first registered worker's INFO: every replica's must agree
        self._told: set[str] = set()  # refusals of workers logged at ERROR already
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="teacher-proxy", daemon=True)

    def start(self) -> "Proxy":
        self._thread.start()
        logger.info("teacher proxy: clients -> %s, workers -> %s", self.frontend_address,
                    self.backend_address)
        return self

    @property
    def num_workers(self) -> int:
        """Workers registered now (each serves one request at a time)."""
        return self._num_registered

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for side in (self._front, self._back):
            side.socket.close()
        self._refusals.flush()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for side in (self._front, self._back):
            poller.register(side.socket, zmq.POLLIN)
        next_sweep = time.monotonic()
        while not self._stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            for side in (self._front, self._back):
                if side.socket in ready:
                    self._pump(side)
            if time.monotonic() >= next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + POLL_MS / 1000

    def _pump(self, side: _Side) -> None:
        view = memoryview(self._scratch)
        for _ in range(_CHUNKS_PER_TURN):
            try:
                identity = side.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            size = side.socket.recv_into(self._scratch)
            connection = side.connections.get(identity)
            if size == 0:  # libzmq's notification of a new or a lost connection
                if connection is not None:
                    self._forget(side, connection, "the peer disconnected")
                elif self._closed.pop(identity, False) is False:
                    self._accept(side, identity)
            elif connection is not None:
                if size > len(self._scratch):
                    self._close(side, connection, f"a chunk of {size} bytes")
                    continue
                try:
                    self._receive(side, connection, view[:size])
                except Exception:  # noqa: BLE001 - one connection's bug must not stop the proxy
                    logger.exception("teacher proxy: failed on a %s connection; closing it", side.name)
                    self._close(side, connection, "internal error")

    def _accept(self, side: _Side, identity: bytes) -> None:
        if side.unproven and (len(side.unproven) >= self._max_unproven
                              or len(side.connections) >= self._max_connections):
            # The oldest stranger makes room: one who holds the secret answers its challenge within
            # a round trip, and strangers cannot keep it out by opening connections and idling.
            oldest = side.connections[next(iter(side.unproven))]
            self._close(side, oldest, f"{len(side.unproven)} connections have not answered their "
                                      "challenge; the oldest makes room for a new one")
        if len(side.connections) >= self._max_connections:
            self._refusals.refused("%s connection: %d are open already", side.name, self._max_connections)
            self._send_close(side, identity)
            return
        reader = zmtp.FrameReader(4, UNPROVEN_BYTES)  # [delimiter or route, empty,] mac, header
        side.connections[identity] = _Connection(identity=identity, reader=reader, opened=time.monotonic())
        side.unproven[identity] = None
        self._send(side, identity, [], raw=zmtp.SERVER_GREETING)

    def _receive(self, side: _Side, connection: _Connection, data: memoryview) -> None:
        while data:
            # An unproven connection is read one message at a time: the bytes after the answer to its
            # challenge must meet the bounds that answer earns, not the stranger's few KiB.
            proven, before = connection.proven, connection.reader.pending_bytes
            try:
                if proven:
                    messages, used, failure = connection.reader.feed(data), len(data), None
                else:
                    (messages, used), failure = connection.reader.feed_one(data), None
            except zmtp.ZmtpError as error:
                # Only the text: the exception's traceback holds the reader's frame, and through it
                # the partial message, in a reference cycle that only the cyclic collector would free
                # (the proxy loop allocates too little to run it often): a flood of cut connections
                # then held tens of times the message limit.
                messages, used, failure = [], len(data), str(error)
            if side is self._front and proven:
                # Counted before any close: _forget takes back what the reader holds now, and bytes
                # that arrived before the error in this same chunk must have been added first.
                self._partial_bytes += connection.reader.pending_bytes - before
            if failure is not None:
                self._close(side, connection, failure)
                return
            if connection.reader.greeted and not connection.ready_sent:
                connection.ready_sent = True
                connection.nonce = secrets.token_hex(16)
                self._send(side, connection.identity, [], raw=zmtp.ready_command(b"ROUTER"))
                self._send(side, connection.identity, [*side.envelope, *wire.encode(
                    wire.CHALLENGE, "challenge", {"nonce": connection.nonce}, secret=self._secret)])
            for frames in messages:
                if connection.identity not in side.connections:
                    return
                if side is self._front:
                    self._from_client(connection, frames)
                else:
                    self._from_worker(connection, frames)
            if connection.identity not in side.connections:
                return
            data = data[used:]
        if (side is self._front and connection.proven
                and self._partial_bytes + self._queued_bytes > self._max_pending):
            # Only a proven client holds any of the budget: it holds the secret, so it is told
            # (busy) instead of cut off; the rest of its message is read but not held.
            before = connection.reader.pending_bytes
            connection.reader.discard()
            self._partial_bytes += connection.reader.pending_bytes - before

    def _sweep(self) -> None:
        """Closes connections that did not finish their handshake, registration or message in time."""
        now = time.monotonic()
        for side in (self._front, self._back):
            for connection in list(side.connections.values()):
                age, reader = now - connection.opened, connection.reader
                if not reader.ready and age > self._handshake_s:
                    self._close(side, connection, f"no ZMTP handshake within {self._handshake_s:.0f} s")
                elif side is self._front and not connection.proven and age > self._verification_s:
                    self._close(side, connection, f"no answer to the challenge within {self._verification_s:g} s")
                elif side is self._back and not connection.proven and age > self._registration_s:
                    self._close(side, connection, f"no registration within {self._registration_s:.0f} s")
                elif (side is self._front and reader.message_started is not None
                      and now - reader.message_started > self._message_s):
                    # Client side only: worker connections are registered (authenticated) or bounded
                    # by the registration timeout, and their results may be large on a slow link.
                    self._close(side, connection, f"a message unfinished after {self._message_s:.0f} s: "
                                f"{reader.pending_bytes} of {reader.declared_bytes} declared bytes arrived, "
                                f"in {reader.num_pending_frames} frames")

    # ---- clients --------------------------------------------------------------------------------
    def _from_client(self, connection: _Connection, frames: list) -> None:
        if frames[0]:
            self._refuse(connection, wire.WireError(ErrorCode.BAD_FRAME, "the first frame must be the "
                                                    "empty delimiter a DEALER sends"), frames)
            return
        body = frames[1:]
        if isinstance(frames, zmtp.Discarded):  # a proven client's message that passed the budget
            self._busy(connection, wire.peek_request_id(body) or "unknown", sum(map(len, body)))
            return
        if not connection.proven:
            self._prove(self._front, connection, body)
            return
        try:
            message = wire.decode(body, self._limits, self._secret, expect=wire.REQUEST_TYPES)
        except wire.WireError as error:
            self._refuse(connection, error, body)
            return
        nbytes = sum(len(frame) for frame in body)
        if (len(self._queue) >= self._max_queued
                or self._partial_bytes + self._queued_bytes + nbytes > self._max_pending):
            # Logged with the figures that decided it, so that an operator can tell a full queue
            # from unfinished messages holding the budget.
            self._busy(connection, message.request_id, nbytes)
            return
        self._queue.append(_Request(client=connection.identity, request_id=message.request_id, body=body,
                                    nbytes=nbytes, kind=message.type))
        self._queued_bytes += nbytes
        self._dispatch()

    def _busy(self, connection: _Connection, request_id: str, nbytes: int) -> None:
        # Logged with the figures that decided it, so that an operator can tell a full queue from
        # unfinished messages holding the budget.
        self._refusals.refused("request %s of %d bytes as busy: %d requests (%d bytes) queued, %d bytes "
                               "of unfinished messages, max_pending_bytes=%d", request_id, nbytes,
                               len(self._queue), self._queued_bytes, self._partial_bytes, self._max_pending)
        self._send(self._front, connection.identity, [b"", *wire.error_frames(
            request_id, ErrorCode.UNAVAILABLE, f"the teacher is busy ({len(self._queue)} requests queued, "
            f"{self._queued_bytes + self._partial_bytes} of {self._max_pending} pending bytes); retry later",
            self._secret)])

    def _refuse(self, connection: _Connection, error: wire.WireError, body: list) -> None:
        self._refusals.refused("client message (%s)", error)
        if not error.authenticated:
            if connection.refusals >= MAX_UNSIGNED_REFUSALS:
                return  # a stranger has been told enough times; the rest is dropped unanswered
            connection.refusals += 1
        self._send(self._front, connection.identity, [b"", *wire.refusal_frames(error, body, self._secret)])

    def _prove(self, side: _Side, connection: _Connection, body: list) -> wire.Message | None:
        """Checks the answer to a connection's challenge; the message when the connection is proven now.

        A refused answer is told (unsigned unless the sender is authenticated) and counted; the
        connection is closed at the third.
        """
        try:
            message = wire.decode(body, self._limits, self._secret, expect=(side.answer,))
            nonce = message.meta.get("nonce")
            if not (isinstance(nonce, str) and hmac.compare_digest(nonce.encode(), connection.nonce.encode())):
                raise wire.WireError(ErrorCode.BAD_SIGNATURE, f"the {side.answer} answers another challenge")
        except wire.WireError as error:
            self._refusals.refused("%s connection's %s (%s)", side.name, side.answer, error)
            connection.refusals += 1
            detail = f"{side.answer} refused: {error.detail}"
            if side is self._front and not error.authenticated:  # a reply with its id would be signed
                detail += "; answer the challenge the proxy sent on this connection, signed with its secret"
            self._send(side, connection.identity, [*side.envelope, *wire.error_frames(
                wire.UNAUTHENTICATED_ID, error.code, detail, None)])
            if connection.refusals >= _HELLO_ATTEMPTS:
                self._close(side, connection, f"{_HELLO_ATTEMPTS} refused answers to the challenge")
            return None
        connection.proven, connection.refusals = True, 0
        side.unproven.pop(connection.identity, None)
        connection.reader.max_frames = self._limits.max_tensors + 3 + (side is self._back)  # + route
        connection.reader.max_bytes = self._limits.max_message_bytes + (256 if side is self._back else 0)
        if side is self._front:
            self._partial_bytes += connection.reader.pending_bytes  # uncounted while unproven
        return message

    def _dispatch(self) -> None:
        while self._queue and self._idle:
            worker = self._back.connections.get(self._idle.popleft())
            if worker is None or worker.busy is not None:
                continue
            request = self._queue.popleft()
            self._queued_bytes -= request.nbytes
            if request.client not in self._front.connections:  # the client gave up on it
                self._idle.appendleft(worker.identity)
                continue
            worker.busy = request
            self._send(self._back, worker.identity, [request.client, b"", *request.body])
        if (self._queue and time.monotonic() - self._no_worker_warned > 60
                and not any(c.proven for c in self._back.connections.values())):
            self._no_worker_warned = time.monotonic()
            logger.warning("%d teacher requests wait and no worker is registered at %s", len(self._queue),
                           self.backend_address)

    # ---- workers --------------------------------------------------------------------------------
    def _from_worker(self, connection: _Connection, frames: list) -> None:
        if not connection.proven:
            self._register(connection, frames)
            return
        request = connection.busy
        if len(frames) < 3 or frames[1] or request is None or frames[0] != request.client:
            self._refusals.refused("a message from a worker that answers no request it holds")
            return
        connection.busy = None
        if request.kind == wire.INFO and (problem := self._changed_info(connection, frames[2:])):
            # Clients bound the ids they accept by the INFO: one the proxy did not check against the registration
            # (which it compared with the other replicas') could widen that bound.
            logger.error("teacher worker cut off: %s", problem)
            self._send(self._front, request.client, [b"", *wire.error_frames(
                request.request_id, ErrorCode.BAD_OUTPUT, problem, self._secret)])
            self._close(self._back, connection, problem)
            return
        self._send(self._front, request.client, [b"", *frames[2:]])
        self._idle.append(connection.identity)
        self._dispatch()

    def _changed_info(self, connection: _Connection, body: list) -> str | None:
        """Why a worker's INFO reply cannot be forwarded (it differs from the INFO it registered), or None."""
        try:
            message = wire.decode(body, self._limits, self._secret, expect=(wire.INFO_RESULT,))
        except wire.WireError:
            return None  # an error reply, or one that does not verify: the client refuses what it cannot trust
        registered, answered = connection.info or {}, message.meta
        differences = [f"{field}: {registered.get(field)!r} -> {answered.get(field)!r}"
                       for field in sorted(set(registered) | set(answered))
                       if registered.get(field) != answered.get(field)]
        if not differences:
            return None
        return ("the teacher worker answered an INFO that differs from the one it registered ("
                + "; ".join(differences) + ")")

    def _register(self, connection: _Connection, frames: list) -> None:
        if len(frames) < 3 or frames[1]:
            frames = [b"", b"", b""]  # refused below as a malformed registration
        message = self._prove(self._back, connection, frames[2:])
        if message is None or not self._same_teacher(connection, message):
            return
        self._num_registered += 1
        logger.info("teacher worker registered (%s, %d registered)", message.meta.get("name", "?"),
                    self._num_registered)
        self._idle.append(connection.identity)
        self._dispatch()

    def _same_teacher(self, connection: _Connection, message: wire.Message) -> bool:
        """Whether a worker serves the teacher the first registered one served; refuses it otherwise.

        Replicas are interchangeable to a client (any of them answers any request), so a worker of
        another model, tokenizer or dtype would mix two teachers' answers without notice.
        """
        info = message.meta.get("info")
        problem = None
        if not isinstance(info, dict):
            problem = "the registration carries no INFO (a worker older than this proxy?)"
        elif malformed := identity.info_problems(info):
            problem = "its INFO is malformed: " + "; ".join(malformed)
        elif self._teacher is None:
            self._teacher = info
            logger.info("teacher proxy serves %s", identity.identity(info))
        elif differences := identity.differences(self._teacher, info):
            problem = ("it serves another teacher than the first worker registered here ("
                       + "; ".join(differences) + "): replicas behind one proxy must be one model")
        if problem is None:
            connection.info = info
            return True
        if problem not in self._told:  # once at ERROR; a worker that keeps coming back is rate-limited
            self._told.add(problem)
            logger.error("teacher worker %s refused: %s", message.meta.get("name", "?"), problem)
        self._send(self._back, connection.identity, [*self._back.envelope, *wire.error_frames(
            "register", ErrorCode.UNSUPPORTED, f"registration refused: {problem}", self._secret)])
        connection.proven = False  # never admitted: not counted among the registered
        self._close(self._back, connection, problem)
        return False

    # ---- connections ----------------------------------------------------------------------------
    def _send(self, side: _Side, identity: bytes, frames: list, raw: bytes | None = None) -> bool:
        """Sends one message (or ``raw`` protocol bytes); False when the peer is gone.

        Never blocks: with no send limit (SNDHWM 0) only a connection that is closing refuses
        bytes, and a blocking send to it would wait forever.
        """
        try:
            for buffer in ([raw] if raw is not None else zmtp.encode(frames)):
                side.socket.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
                side.socket.send(buffer, zmq.NOBLOCK, copy=len(buffer) < 1 << 16)
            return True
        except zmq.ZMQError:  # EAGAIN or EHOSTUNREACH: the connection is closing or closed
            return False

    def _send_close(self, side: _Side, identity: bytes) -> None:
        self._closed[identity] = None
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)
        self._send(side, identity, [], raw=b"")  # an empty STREAM message closes the connection

    def _close(self, side: _Side, connection: _Connection, reason: str) -> None:
        self._refusals.refused("%s connection closed: %s", side.name, reason)
        if self._forget(side, connection, reason):
            self._send_close(side, connection.identity)

    def _forget(self, side: _Side, connection: _Connection, reason: str) -> bool:
        """Drops the state of a connection (closed by either end); False if it was gone already."""
        if side.connections.pop(connection.identity, None) is None:
            return False
        side.unproven.pop(connection.identity, None)
        if side is self._front and connection.proven:
            self._partial_bytes -= connection.reader.pending_bytes
        connection.reader.release()  # the partial message goes now, whoever still holds the reader
        if side is self._front:
            kept = [r for r in self._queue if r.client != connection.identity]
            self._queued_bytes -= sum(r.nbytes for r in self._queue) - sum(r.nbytes for r in kept)
            self._queue = collections.deque(kept)
        if side is self._back and connection.proven:
            self._num_registered -= 1
        if side is self._back and connection.busy is not None:
            # Signed, so the client trusts it and retries at once rather than after its timeout.
            logger.warning("a teacher worker left while scoring request %s (%s)",
                           connection.busy.request_id, reason)
            self._send(self._front, connection.busy.client, [b"", *wire.error_frames(
                connection.busy.request_id, ErrorCode.BACKEND_FAILED, "the worker scoring this "
                "request disconnected", self._secret)])
        return True
