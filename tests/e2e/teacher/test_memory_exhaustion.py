"""A real teacher server under a multi-frame memory attack keeps its RSS within a few message limits.

ZMQ's ``MAXMSGSIZE`` bounds one frame, and libzmq hands a multipart message to the application only
once every frame has arrived: many frames just under the limit once took a server from 468 MB to
3.69 GB. Here two unauthenticated peers each send one message of 24 frames of 7 MiB (168 MiB) against
an 8 MiB limit; the server's peak RSS may grow by a small multiple of the limit only, and it must
answer a valid request exactly afterwards.
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

pytestmark = pytest.mark.e2e

LIMIT_MB = 8
FRAME_BYTES = 7 * 2**20
FRAMES_PER_MESSAGE = 24
ATTACKERS = 2
MAX_GROWTH_BYTES = 4 * LIMIT_MB * 2**20  # "a small multiple of the configured message limit"


def _status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` memory figure in bytes (VmRSS, VmHWM)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("memory")
    teacher = build_tiny_teacher(directory / "teacher", num_layers=1)
    secret_file, secret = procs.write_secret(directory)
    process = procs.start(["launch/teacher_server.py", "serve", "--frontend", "tcp://127.0.0.1:0",
                           "--model", str(teacher), "--max-message-mb", str(LIMIT_MB),
                           "--secret-file", str(secret_file)],
                          "READY frontend=", 180, directory / "server.log")
    address = process.ready_line.split("frontend=")[1].split()[0]
    yield process, address, secret, teacher
    procs.stop(process)


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
    rng = np.random.default_rng(0)
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(3, 512, 30), response_start=10)],
                       top_k=8)
    retry = RetryPolicy(attempt_timeout_s=30, deadline_s=90, backoff_s=0.2)
    with build_client("zmq", address=address, secret=secret, retry=retry) as client:
        client.score(batch)  # warm: the first forward allocates what every later one reuses
    baseline = _status(process.pid, "VmRSS")
    pathlib.Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS from here on

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
