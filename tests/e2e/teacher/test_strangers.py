"""Strangers who spend bandwidth, or only sockets, cannot make a signed call fail.

A real teacher service (a proxy process and a worker process, an 8 MiB message limit, so a 16 MiB
pending budget) while peers without the secret:

* burst two messages to just under the limit and hold them open (once every call with the trainer's
  default retry policy that started during a hold failed, after 15.5 s of "busy");
* trickle 1 MB/s in all over two connections after half a message each, never finishing one (once 3
  trainer-policy calls and 17 of 72 short-policy calls failed: the budget filled within seconds);
* at the default 512 MiB limit, stream 38 MB/s in all over two connections (once a trainer-policy call
  failed every 30 s and the proxy grew by 1.07 GB; slow tier);
* open 4,096 connections that finish the ZMTP handshake and send nothing (once the service was
  blocked at zero bandwidth: a trainer-policy call failed after 300 s).

Each signed call is made with the trainer's default policy (``TeacherConfig().retry()``, its deadline
cut to one attempt's 60 s) and must be answered exactly; every stranger's connection must be closed.
"""

import dataclasses
import struct
import threading
import time

import numpy as np
import pytest

from megatron_gkd.teacher import ScoreBatch, SequenceRequest, build_client
from megatron_gkd.teacher.config import TeacherConfig
from megatron_gkd.teacher.protocol import wire, zmtp
from tests.e2e.teacher import procs
from tests.unit.teacher import peers

pytestmark = pytest.mark.e2e

LIMIT_MB = 8
LIMIT = LIMIT_MB * 2**20
WINDOW_S = 15.0  # calls are made while the strangers hold on, for this long
IDLE_STRANGERS = 4096
MAX_UNPROVEN = 256  # the proxy's default max_unproven_connections
VERIFICATION_S = 5.0  # the proxy's default verification_timeout_s


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with procs.service(tmp_path_factory.mktemp("strangers"), max_message_mb=LIMIT_MB) as running:
        # The trainer's default policy, with the deadline of one attempt (60 s, not 300 s): a blocked
        # service fails a call here within a minute.
        retry = dataclasses.replace(TeacherConfig().retry(), deadline_s=TeacherConfig().attempt_timeout_s)
        client = build_client("zmq", address=running["frontend"], secret=running["secret"], retry=retry)
        batch = _batch()
        expected = client.score(batch)[0]
        yield dict(running, client=client, batch=batch, expected=expected)
        client.close()


@pytest.fixture(scope="module")
def service_at_default_limit(tmp_path_factory):
    limit_mb = wire.Limits().max_message_bytes // 2**20  # the service's default (512 MiB)
    with procs.service(tmp_path_factory.mktemp("strangers_default"), max_message_mb=limit_mb) as running:
        retry = dataclasses.replace(TeacherConfig().retry(), deadline_s=TeacherConfig().attempt_timeout_s)
        client = build_client("zmq", address=running["frontend"], secret=running["secret"], retry=retry)
        batch = _batch()
        expected = client.score(batch)[0]
        yield dict(running, client=client, batch=batch, expected=expected, limit=limit_mb * 2**20)
        client.close()


def _batch() -> ScoreBatch:
    return ScoreBatch(sequences=[SequenceRequest(token_ids=np.arange(3, 40) * 7 % 512, response_start=9)], top_k=8)


def _calls_during(service, window_s: float) -> tuple[int, list[str]]:
    """Signed calls with the trainer's default policy, one after another, started within ``window_s``."""
    calls, failures, end = 0, [], time.monotonic() + window_s
    while time.monotonic() < end:
        calls += 1
        try:
            output = service["client"].score(service["batch"])[0]
            np.testing.assert_array_equal(output.topk_ids, service["expected"].topk_ids)
        except Exception as error:  # noqa: BLE001 - every failure is counted and shown
            failures.append(f"{type(error).__name__}: {error}"[:300])
        time.sleep(0.1)
    return calls, failures


class _Stranger(threading.Thread):
    """A peer without the secret: declares a frame of ``declared`` bytes, sends ``burst`` of them at once
    and then ``rate`` bytes a second, never the last one, and connects again whenever it is cut."""

    def __init__(self, address: str, declared: int, burst: int, rate: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.address, self.declared, self.burst, self.rate, self.stop = address, declared, burst, rate, stop
        self.connections = 0

    def run(self):
        while not self.stop.is_set():
            self.connections += 1
            try:
                with peers.handshaken(self.address) as sock:
                    sock.sendall(bytes([zmtp.MORE, 0]) + bytes([zmtp.LONG]) + struct.pack(">Q", self.declared)
                                 + bytes(self.burst))
                    sent = self.burst
                    while not self.stop.is_set():
                        step = min(int(self.rate / 10), self.declared - 1 - sent)
                        if step > 0:
                            sock.sendall(bytes(step))
                            sent += step
                        self.stop.wait(0.1)
                        if not peers.still_open(sock):
                            break
            except OSError:  # cut by the proxy: connect again, as an attacker would
                pass
            self.stop.wait(0.05)


def _with_strangers(service, count: int, burst: int, rate: float, window_s: float):
    stop = threading.Event()
    declared = service.get("limit", LIMIT) - 1
    strangers = [_Stranger(service["frontend"], declared, burst, rate, stop) for _ in range(count)]
    for stranger in strangers:
        stranger.start()
    time.sleep(1.0)  # the bursts are in
    try:
        calls, failures = _calls_during(service, window_s)
    finally:
        stop.set()
        for stranger in strangers:
            stranger.join()
    print(f"{calls - len(failures)}/{calls} signed calls answered while {count} strangers held on "
          f"({sum(s.connections for s in strangers)} stranger connections)")
    assert calls >= 5 and not failures, f"{len(failures)}/{calls} signed calls failed, first: {failures[0]}"


def test_strangers_bursting_to_the_limit_and_holding(service):
    _with_strangers(service, count=2, burst=LIMIT - 2, rate=0.0, window_s=WINDOW_S)
    service["client"].score(service["batch"])


def test_strangers_trickling_a_megabyte_a_second(service):
    _with_strangers(service, count=2, burst=LIMIT // 2, rate=2**19, window_s=WINDOW_S)


@pytest.mark.slow
def test_strangers_streaming_38_megabytes_a_second_at_the_default_limit(service_at_default_limit):
    service = service_at_default_limit
    rss_before = _proxy_rss(service)
    _with_strangers(service, count=2, burst=0, rate=19e6, window_s=30.0)
    growth = _proxy_rss(service, "VmHWM") - rss_before
    print(f"proxy peak RSS grew by {growth / 2**20:.1f} MiB under 38 MB/s of strangers")
    assert growth < 64 * 2**20, f"the proxy grew by {growth / 2**20:.0f} MiB holding strangers' bytes"


def _proxy_rss(service, field: str = "VmRSS") -> int:
    with open(f"/proc/{service['proxy'].pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def test_thousands_of_idle_strangers_neither_block_signed_calls_nor_stay(service):
    strangers = [peers.handshaken(service["frontend"]) for _ in range(IDLE_STRANGERS)]
    opened = time.monotonic()
    try:
        time.sleep(1.0)
        still_open = sum(peers.still_open(sock) for sock in strangers)
        calls, failures = _calls_during(service, 3.0)
        assert calls >= 3 and not failures, f"{len(failures)}/{calls} signed calls failed: {failures[:1]}"
        assert still_open <= MAX_UNPROVEN, f"{still_open} of {IDLE_STRANGERS} idle strangers kept a connection"
        time.sleep(max(0.0, opened + VERIFICATION_S + 2.0 - time.monotonic()))
        left = sum(peers.still_open(sock) for sock in strangers)
        assert left == 0, f"{left} idle strangers still connected {VERIFICATION_S + 2:.0f} s after connecting"
    finally:
        for sock in strangers:
            sock.close()
    print(f"{still_open} of {IDLE_STRANGERS} idle strangers were still connected after 1 s, none after "
          f"{VERIFICATION_S + 2:.0f} s; {calls} signed calls answered meanwhile")
