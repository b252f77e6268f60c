"""Peers of the teacher proxy for tests: a DEALER or a raw TCP socket that answered its challenge.

Every connection to the proxy gets a challenge and may send only a few KiB until it answers (HELLO,
signed); these helpers answer it as the ``zmq`` client does, so that a test can then send what it
likes as a peer that holds the secret.
"""

import socket
import threading
import time

import zmq

from megatron_gkd.teacher.protocol import wire, zmtp


def hello(challenge_body: list, secret: bytes | None) -> list[bytes]:
    """The HELLO frames answering a challenge (its frames without the delimiter)."""
    nonce = wire.peek_meta(challenge_body).get("nonce")
    return wire.encode(wire.HELLO, "hello", {"nonce": nonce}, secret=secret)


def proven_dealer(address: str, secret: bytes | None, timeout_s: float = 10.0) -> zmq.Socket:
    """A DEALER connected to ``address`` that has answered the proxy's challenge."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    if not sock.poll(int(timeout_s * 1000)):
        sock.close()
        raise TimeoutError(f"no challenge from {address} within {timeout_s} s")
    frames = sock.recv_multipart()
    assert wire.peek_type(frames[1:]) == wire.CHALLENGE, frames
    sock.send_multipart([b"", *hello(frames[1:], secret)])
    return sock


def raw(address: str, timeout_s: float = 10.0) -> socket.socket:
    """A plain TCP connection to a ``tcp://host:port`` address."""
    host, port = address.rsplit("/", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def handshaken(address: str) -> socket.socket:
    """A raw connection that sent the ZMTP greeting and READY of a DEALER, and nothing else."""
    sock = raw(address)
    sock.sendall(zmtp._greeting(False) + zmtp.ready_command(b"DEALER"))
    return sock


def still_open(sock: socket.socket) -> bool:
    """True while the peer has not closed ``sock`` (reads what it sent, without waiting)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def proven_raw(address: str, secret: bytes | None, timeout_s: float = 10.0) -> socket.socket:
    """A raw connection that completed the handshake and answered the challenge (HELLO sent)."""
    sock = handshaken(address)
    reader = zmtp.FrameReader(max_frames=4, max_bytes=4096, peer_socket_type=b"ROUTER")
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        messages = reader.feed(sock.recv(4096))
        if messages:
            body = [bytes(frame) for frame in messages[0][1:]]
            assert wire.peek_type(body) == wire.CHALLENGE, body
            sock.sendall(b"".join(zmtp.encode([b"", *hello(body, secret)])))
            return sock
    sock.close()
    raise TimeoutError(f"no challenge from {address} within {timeout_s} s")



class FakeWorker:
    """A worker on a real proxy's backend that registers with ``secret`` and ``info`` (the INFO it registers: the
    proxy forwards only INFO replies that equal it) and answers every request with ``answer(request body) -> reply
    body`` (a stand-in for a teacher that lies, holding the secret)."""

    def __init__(self, address: str, secret: bytes | None, answer, info: dict | None = None):
        self._secret, self._answer, self._stop = secret, answer, threading.Event()
        self._info = info if info is not None else {"name": "fake"}
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(20):
                continue
            route, _, *body = self._socket.recv_multipart()
            if wire.peek_type(body) == wire.CHALLENGE:
                self._socket.send_multipart([route, b"", *wire.encode(wire.REGISTER, "register", {
                    "nonce": wire.peek_meta(body).get("nonce"), "name": "fake", "info": self._info},
                    secret=self._secret)])
            else:
                self._socket.send_multipart([route, b"", *self._answer(body)])
        self._socket.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
