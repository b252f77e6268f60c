"""The teacher service: a ROUTER/DEALER proxy in front of any number of scoring workers.

Clients (DEALER) connect to the proxy's frontend (ROUTER); workers (DEALER) connect to its backend
(DEALER), possibly from other hosts, and the proxy hands requests to connected workers in turn. A
worker answers every message it can attribute with a result or a typed error, and drops what it
cannot (no routing envelope). ``launch/teacher_server.py`` is the command line.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from urllib.parse import urlsplit

import zmq

from megatron_gkd.teacher import codec, wire
from megatron_gkd.teacher.backends import TeacherBackend
from megatron_gkd.teacher.types import ErrorCode, TeacherError

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often loops look at their stop flag


def is_loopback(address: str) -> bool:
    """True for ``ipc://``/``inproc://`` and TCP addresses on 127.0.0.0/8, ::1 or localhost."""
    scheme = address.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", interface names and host names may reach other machines


def check_exposure(address: str, secret: bytes | None, insecure: bool) -> None:
    """Refuses a non-loopback address without a shared secret unless ``insecure`` is set.

    Raises:
        ValueError: ``address`` leaves this host and neither a secret nor ``insecure`` is given.
    """
    if is_loopback(address) or secret:
        return
    if not insecure:
        raise ValueError(
            f"{address} is reachable from other hosts; give a shared secret (--secret-file or "
            "MEGATRON_GKD_TEACHER_SECRET) so every message is HMAC-signed, or pass --insecure"
        )
    logger.warning("teacher service on %s WITHOUT authentication (--insecure): anyone who can reach "
                   "it can use the teacher", address)


def _bind(socket: zmq.Socket, address: str) -> str:
    socket.bind(address)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class Proxy:
    """Forwards frames between clients (frontend ROUTER) and workers (backend DEALER) in a thread.

    It never parses payloads; workers verify and answer. ``MAXMSGSIZE`` makes ZMQ drop the
    connection of a peer that sends a frame over the size limit before it is buffered.

    Args:
        frontend: address clients connect to (``tcp://127.0.0.1:0`` picks a free port).
        backend: address workers connect to.
        secret: shared secret; required for non-loopback addresses unless ``insecure``.
        insecure: allow non-loopback addresses without a secret (logs a warning).
        limits: size limits of received messages.
    """

    def __init__(self, frontend: str, backend: str, secret: bytes | None = None,
                 insecure: bool = False, limits: wire.Limits = wire.Limits()):
        for address in (frontend, backend):
            check_exposure(address, secret, insecure)
        self._context = zmq.Context.instance()
        self._frontend = self._context.socket(zmq.ROUTER)
        self._backend = self._context.socket(zmq.DEALER)
        for socket in (self._frontend, self._backend):
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self.frontend_address = _bind(self._frontend, frontend)
        self.backend_address = _bind(self._backend, backend)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="teacher-proxy", daemon=True)

    def start(self) -> "Proxy":
        self._thread.start()
        logger.info("teacher proxy: clients -> %s, workers -> %s", self.frontend_address,
                    self.backend_address)
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._frontend, zmq.POLLIN)
        poller.register(self._backend, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(POLL_MS):
                other = self._backend if socket is self._frontend else self._frontend
                frames = socket.recv_multipart(copy=True)
                try:
                    # A DEALER without connected workers would block; the request is dropped instead
                    # and the client retries after its attempt timeout.
                    other.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    logger.warning("no teacher worker connected; dropped a request")
        self._frontend.close()
        self._backend.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Worker:
    """Connects to a proxy's backend and answers requests with ``backend``.

    Args:
        connect: the proxy's backend address.
        backend: the scoring backend.
        secret: shared secret (must match the clients').
        insecure: allow a non-loopback address without a secret.
        limits: size limits of received messages.
    """

    def __init__(self, connect: str, backend: TeacherBackend, secret: bytes | None = None,
                 insecure: bool = False, limits: wire.Limits = wire.Limits()):
        check_exposure(connect, secret, insecure)
        self._backend, self._secret, self._limits = backend, secret, limits
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self._socket.connect(connect)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_answered = 0

    def serve_forever(self) -> None:
        """Answers messages until :meth:`close` (or the process ends)."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                self._handle(self._socket.recv_multipart(copy=True))
        self._socket.close()

    def start(self) -> "Worker":
        """Serves in a background thread (in-process workers, tests)."""
        self._thread = threading.Thread(target=self.serve_forever, name="teacher-worker", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _handle(self, frames: list[bytes]) -> None:
        # The proxy's ROUTER prepends the client's identity; the client's DEALER sends an empty
        # delimiter first. Without that delimiter no reply can be routed, so the message is dropped.
        if b"" not in frames[:4]:
            logger.warning("dropped a message without routing envelope (%d frames)", len(frames))
            return
        split = frames.index(b"") + 1
        envelope, body = frames[:split], frames[split:]
        try:
            reply = self._answer(body)
        except TeacherError as error:
            # Errors for unauthenticated messages are sent unsigned: a client without the secret
            # can still learn why it was refused, and they carry no data.
            signed = error.code != ErrorCode.BAD_SIGNATURE
            logger.info("refused a message: %s", error)
            reply = wire.error_frames(wire.peek_request_id(body) or "unknown", error.code,
                                      error.detail, self._secret if signed else None)
        except Exception as error:  # noqa: BLE001 - a backend bug must not kill the worker
            logger.exception("teacher backend failed")
            reply = wire.error_frames(wire.peek_request_id(body) or "unknown",
                                      ErrorCode.BACKEND_FAILED, f"{type(error).__name__}: {error}",
                                      self._secret)
        size = sum(len(frame) for frame in reply)
        if size > self._limits.max_message_bytes:
            # Sent anyway, ZMQ's MAXMSGSIZE at the proxy would cut this worker off.
            reply = wire.error_frames(wire.peek_request_id(body) or "unknown", ErrorCode.TOO_LARGE,
                                      f"the result has {size} bytes, over the limit of "
                                      f"{self._limits.max_message_bytes}; send smaller batches",
                                      self._secret)
        self._socket.send_multipart(envelope + reply, copy=False)
        self.num_answered += 1

    def _answer(self, body: list[bytes]) -> list[bytes]:
        message = wire.decode(body, self._limits, self._secret, expect=(wire.SCORE, wire.INFO))
        if message.type == wire.INFO:
            return wire.encode(wire.INFO_RESULT, message.request_id, self._backend.info().to_dict(),
                               secret=self._secret)
        batch = codec.decode_request(message)
        info = self._backend.info()
        if batch.num_requested is not None and not info.supports_requested_ids:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"the {info.name} backend cannot score "
                               "requested ids (TCAD); use the hf or megatron backend")
        if batch.temperature != 1.0 and not info.supports_temperature:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"the {info.name} backend scores at "
                               f"temperature 1.0 only, got {batch.temperature}")
        outputs = self._backend.score(batch)
        for index, (output, sequence) in enumerate(zip(outputs, batch.sequences, strict=True)):
            output.validate(sequence.num_response_tokens, batch.top_k, batch.num_requested,
                            name=f"sequence {index} of request {message.request_id}")
        return codec.encode_result(message.request_id, outputs, self._secret)
