""":class:`~megatron_gkd.trainer.preemption.Preemption` alone (#31 item 2), in a gloo world of one: SIGTERM and
SIGUSR1 are recorded and reported by :meth:`requested` (the run checkpoints after its step), nothing is reported
without one, and a second signal stops the process at once (in a child process)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from megatron_gkd.trainer.preemption import Preemption


@pytest.fixture(scope="module")
def control():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield dist.group.WORLD
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    dist.destroy_process_group()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_is_reported_by_requested(control, signum):
    preemption = Preemption(control)
    assert not preemption.requested()
    os.kill(os.getpid(), signum)
    assert preemption.requested() and preemption.signal == signum
    assert preemption.requested()  # it stays requested: the run stops after its checkpoint


def _child(body: str) -> subprocess.CompletedProcess:
    """``body`` run after a Preemption is installed in a gloo world of one, in a child process, which destroys its
    process group before it exits (an exit with a gloo group alive can abort at interpreter finalization, pytorch
    #190489: seen once in the loaded default suite as "terminate called without an active exception", rc -6)."""
    script = textwrap.dedent("""
        import os, signal, socket, sys, time
        import torch.distributed as dist
        from megatron_gkd.trainer.preemption import SAME_REQUEST_S, Preemption
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        preemption = Preemption(dist.group.WORLD)
    """) + textwrap.dedent(body) + "\ndist.destroy_process_group()\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_second_signal_stops_at_once():
    done = _child("""
        os.kill(os.getpid(), signal.SIGTERM)
        print("first handled", preemption.requested(), flush=True)
        time.sleep(SAME_REQUEST_S + 0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running", flush=True)
    """)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert "first handled True" in done.stdout and "still running" not in done.stdout


def test_the_same_request_delivered_twice_is_one():
    """A kill of the job's processes reaches a rank directly and through torchrun, which forwards SIGTERM to its
    workers: both within milliseconds. The rank checkpoints once, as for one signal (before, it stopped at once and
    the run lost its checkpoint)."""
    done = _child("""
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running", preemption.requested(), flush=True)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "still running True" in done.stdout


def test_a_rank_told_by_another_has_not_received_a_signal():
    """:meth:`requested` tells every rank of one rank's signal; the rank's own (torchrun's forward, arriving later) is
    its first, not a second."""
    done = _child("""
        preemption.signal = signal.SIGTERM  # what requested() records when another rank was signalled
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running", preemption.requested(), flush=True)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "still running True" in done.stdout
