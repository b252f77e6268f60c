"""A real teacher server under memory attacks keeps its RSS within its pending budget plus a constant.

ZMQ's ``MAXMSGSIZE`` bounds one frame, and libzmq hands a multipart message to the application only
once every frame has arrived: many frames just under the limit once took a server from 468 MB to
3.69 GB. In the first attack two unauthenticated peers each send one message of 24 frames of 7 MiB
(168 MiB) against an 8 MiB limit. In the second, eight peers without the secret each send five
messages of four frames of (limit - 1 MiB) against a 64 MiB limit, reconnecting whenever they are cut
(a DEALER does so by itself): every connection the proxy closes for a protocol error must give its
buffers back at once, or the server holds about 32 times its limit (+2.0-2.4 GB once). Strangers are
cut at the few KiB a connection may send before it answers its challenge; the same flood from peers
that hold the secret (a buggy client) is read up to the limit on every connection, and shows that a
closed connection's buffers go back at once. After each
attack the server's peak RSS may exceed its baseline by its pending budget plus a constant only, its
RSS must come back near the baseline, and it must answer a valid request exactly.
"""

import pathlib
import threading
import time

import numpy as np
import pytest
import zmq

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher
from tests.e2e.teacher import procs
from tests.unit.teacher import peers

pytestmark = pytest.mark.e2e

LIMIT_MB = 8
FRAME_BYTES = 7 * 2**20
FRAMES_PER_MESSAGE = 24
ATTACKERS = 2
MAX_GROWTH_BYTES = 4 * LIMIT_MB * 2**20  # "a small multiple of the configured message limit"

FLOOD_LIMIT_MB = 64
FLOOD_PEERS, FLOOD_MESSAGES, FLOOD_FRAMES = 8, 5, 4
FLOOD_FRAME_BYTES = (FLOOD_LIMIT_MB - 1) * 2**20
FLOOD_BUDGET_BYTES = 2 * FLOOD_LIMIT_MB * 2**20  # the proxy's default max_pending_bytes
CONSTANT_BYTES = 64 * 2**20  # allocator slack, libzmq's queues, Python's own growth
FLOOD_S = 15.0


def _status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` memory figure in bytes (VmRSS, VmHWM)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _serve(directory: pathlib.Path, limit_mb: int):
    teacher = build_tiny_teacher(directory / "teacher", num_layers=1)
    secret_file, secret = procs.write_secret(directory)
    process = procs.start(["launch/teacher_server.py", "serve", "--frontend", "tcp://127.0.0.1:0",
                           "--model", str(teacher), "--max-message-mb", str(limit_mb),
                           "--secret-file", str(secret_file)],
                          "READY frontend=", 180, directory / "server.log")
    address = process.ready_line.split("frontend=")[1].split()[0]
    return process, address, secret, teacher


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, *rest = _serve(tmp_path_factory.mktemp("memory"), LIMIT_MB)
    yield process, *rest
    procs.stop(process)


@pytest.fixture(scope="module")
def flood_server(tmp_path_factory):
    process, *rest = _serve(tmp_path_factory.mktemp("flood"), FLOOD_LIMIT_MB)
    yield process, *rest
    procs.stop(process)


def _warm_baseline(process, address, secret, batch, retry) -> int:
    """The server's RSS after a first call (which allocates what later ones reuse); resets VmHWM."""
    with build_client("zmq", address=address, secret=secret, retry=retry) as client:
        client.score(batch)
    baseline = _status(process.pid, "VmRSS")
    pathlib.Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    return baseline


def _batch() -> ScoreBatch:
    rng = np.random.default_rng(0)
    return ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(3, 512, 30), response_start=10)],
                      top_k=8)


def _attack(address: str, done: threading.Event) -> None:
    """One peer without the secret sending a single huge multipart message, then lingering."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    frame = zmq.Frame(b"\0" * FRAME_BYTES)
    socket.send(b"", zmq.SNDMORE)
    for _ in range(FRAMES_PER_MESSAGE - 1):
        socket.send(frame, zmq.SNDMORE, copy=False)
    socket.send(frame, copy=False)
    done.wait(20)
    socket.close()


def test_rss_stays_bounded_under_a_multi_frame_attack(server):
    process, address, secret, teacher = server
    batch, retry = _batch(), RetryPolicy(attempt_timeout_s=30, deadline_s=90, backoff_s=0.2)
    baseline = _warm_baseline(process, address, secret, batch, retry)

    done, peak = threading.Event(), [baseline]
    attackers = [threading.Thread(target=_attack, args=(address, done)) for _ in range(ATTACKERS)]
    for thread in attackers:
        thread.start()
    end = time.monotonic() + 8  # the attack's 336 MiB cross loopback well within this
    while time.monotonic() < end:
        peak[0] = max(peak[0], _status(process.pid, "VmRSS"))
        time.sleep(0.005)
    done.set()
    for thread in attackers:
        thread.join()

    with build_client("zmq", address=address, secret=secret, retry=retry) as client:
        output = client.score(batch)[0]  # still serving, and exactly
    ReferenceTeacher(teacher).assert_matches(output, batch.sequences[0].token_ids, 10, 8)
    growth = max(peak[0], _status(process.pid, "VmHWM")) - baseline
    print(f"server RSS {baseline / 2**20:.0f} MiB before the attack, peak growth {growth / 2**20:.1f} MiB "
          f"({ATTACKERS} peers x {FRAMES_PER_MESSAGE} frames x {FRAME_BYTES / 2**20:.0f} MiB, limit "
          f"{LIMIT_MB} MiB)")
    assert growth <= MAX_GROWTH_BYTES, (
        f"RSS grew by {growth / 2**20:.0f} MiB under attack, more than {MAX_GROWTH_BYTES / 2**20:.0f} MiB")


def _send_flood_message(socket: zmq.Socket, frame: zmq.Frame) -> None:
    socket.send(b"", zmq.SNDMORE)
    for index in range(FLOOD_FRAMES):
        socket.send(frame, zmq.SNDMORE if index < FLOOD_FRAMES - 1 else 0, copy=False)


def _flood(address: str, secret: bytes | None, done: threading.Event) -> None:
    """A peer queueing messages far over the limit, reconnecting when cut.

    Without ``secret`` its DEALER reconnects by itself and sends the rest on each new connection;
    with it, every message goes on a fresh connection that answered its challenge first (a buggy
    client holding the secret), so that the proxy reads each message up to the limit.
    """
    frame = zmq.Frame(b"\1" * FLOOD_FRAME_BYTES)  # one buffer, sent by reference every time
    sockets = []
    if secret is None:
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 20)
        socket.connect(address)
        sockets.append(socket)
        for _ in range(FLOOD_MESSAGES):
            _send_flood_message(socket, frame)
    else:
        for _ in range(FLOOD_MESSAGES):
            if done.is_set():
                break
            sockets.append(peers.proven_dealer(address, secret))
            _send_flood_message(sockets[-1], frame)
            done.wait(FLOOD_S / FLOOD_MESSAGES)
    done.wait(FLOOD_S + 10)
    for socket in sockets:
        socket.close()


@pytest.mark.parametrize("with_secret", [False, True], ids=["strangers", "holding_the_secret"])
def test_rss_stays_bounded_under_a_reconnecting_flood(flood_server, with_secret):
    process, address, secret, teacher = flood_server
    batch, retry = _batch(), RetryPolicy(attempt_timeout_s=30, deadline_s=90, backoff_s=0.2)
    baseline = _warm_baseline(process, address, secret, batch, retry)

    done, peak = threading.Event(), baseline
    flooders = [threading.Thread(target=_flood, args=(address, secret if with_secret else None, done))
                for _ in range(FLOOD_PEERS)]
    for thread in flooders:
        thread.start()
    end = time.monotonic() + FLOOD_S
    while time.monotonic() < end:
        peak = max(peak, _status(process.pid, "VmRSS"))
        time.sleep(0.005)
    done.set()
    for thread in flooders:
        thread.join()
    time.sleep(1.0)  # the proxy sees the disconnections
    after = _status(process.pid, "VmRSS")

    with build_client("zmq", address=address, secret=secret, retry=retry) as client:
        output = client.score(batch)[0]  # still serving, and exactly
    ReferenceTeacher(teacher).assert_matches(output, batch.sequences[0].token_ids, 10, 8)
    growth = max(peak, _status(process.pid, "VmHWM")) - baseline
    print(f"server RSS {baseline / 2**20:.0f} MiB before the flood, peak growth {growth / 2**20:.1f} MiB, "
          f"{(after - baseline) / 2**20:.1f} MiB after ({FLOOD_PEERS} reconnecting peers x {FLOOD_MESSAGES} "
          f"messages x {FLOOD_FRAMES} frames x {FLOOD_FRAME_BYTES / 2**20:.0f} MiB, limit {FLOOD_LIMIT_MB} MiB, "
          f"pending budget {FLOOD_BUDGET_BYTES / 2**20:.0f} MiB)")
    assert growth <= FLOOD_BUDGET_BYTES + CONSTANT_BYTES, (
        f"RSS grew by {growth / 2**20:.0f} MiB under the flood, more than the pending budget "
        f"({FLOOD_BUDGET_BYTES / 2**20:.0f} MiB) plus {CONSTANT_BYTES / 2**20:.0f} MiB")
    assert after - baseline <= CONSTANT_BYTES, (
        f"RSS stayed {(after - baseline) / 2**20:.0f} MiB over its baseline after the flood")
