"""A proven client's message left half-sent is cut at its deadline and logged; an idle proven connection
is not. A connection that has not answered its challenge may neither start a large message nor idle."""

import logging
import socket
import struct
import time

import pytest

from megatron_gkd.teacher.protocol import zmtp
from megatron_gkd.teacher.service.proxy import UNPROVEN_BYTES
from megatron_gkd.teacher.service.server import Proxy
from tests.unit.teacher import peers
from tests.unit.teacher.conftest import LIMITS, SECRET

DEADLINE_S = 1.0


@pytest.fixture()
def proxy():
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS,
                  message_timeout_s=DEADLINE_S).start()
    yield proxy
    proxy.close()


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """True once the server closes the connection (EOF) within ``timeout_s``; reads what it sent."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_half_sent_message_is_cut_at_its_deadline_and_logged(proxy, caplog):
    caplog.set_level(logging.INFO, logger="megatron_gkd.teacher.service.proxy")
    idle = peers.proven_raw(proxy.frontend_address, SECRET)  # a client between two requests: never cut
    half = peers.proven_raw(proxy.frontend_address, SECRET)
    opened = time.monotonic()
    half.sendall(bytes([zmtp.MORE, 0]) + bytes([zmtp.LONG]) + struct.pack(">Q", LIMITS.max_message_bytes - 1)
                 + b"\0")
    try:
        assert _closed_within(half, 10 * DEADLINE_S), "the half-sent message was never cut"
        assert time.monotonic() - opened >= DEADLINE_S * 0.9, "cut before its deadline"
        assert not _closed_within(idle, 2 * DEADLINE_S), "an idle connection was cut"
    finally:
        half.close()
        idle.close()
    cut = [r.getMessage() for r in caplog.records if "unfinished" in r.getMessage()]
    assert len(cut) == 1, [r.getMessage() for r in caplog.records]
    # what was cut: how much of how much, in how many frames
    assert f"1 of {LIMITS.max_message_bytes - 1} declared bytes" in cut[0] and "2 frames" in cut[0], cut[0]


def test_the_deadline_must_be_positive():
    with pytest.raises(ValueError, match="message_timeout_s"):
        Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, message_timeout_s=0)


def test_a_stranger_may_neither_start_a_large_message_nor_idle(tmp_path):
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS,
                  verification_timeout_s=DEADLINE_S).start()
    try:
        large = peers.handshaken(proxy.frontend_address)
        large.sendall(bytes([zmtp.MORE, 0]) + bytes([zmtp.LONG]) + struct.pack(">Q", 2 * UNPROVEN_BYTES) + b"\0")
        assert _closed_within(large, DEADLINE_S / 2), "a stranger's large message was not refused at its header"
        idle, opened = peers.handshaken(proxy.frontend_address), time.monotonic()
        assert _closed_within(idle, 10 * DEADLINE_S), "a stranger's idle connection was never closed"
        assert time.monotonic() - opened >= DEADLINE_S * 0.9, "closed before its deadline"
        proven = peers.proven_raw(proxy.frontend_address, SECRET)
        assert not _closed_within(proven, 2 * DEADLINE_S), "a connection that answered its challenge was cut"
    finally:
        proxy.close()
