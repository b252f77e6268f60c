"""Shared fixtures of the trainer's unit tests."""

import signal

import pytest
import torch
import torch.distributed as dist

from megatron_gkd.trainer.preemption import PREEMPTION_SIGNALS


@pytest.fixture(scope="module")
def gloo_world(tmp_path_factory):
    """A gloo world of one process for the module's tests (collectives of the trainer's parts run on it at once)."""
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def signal_handlers():
    """The Trainer installs its preemption handlers in this process; the test session gets its own back after."""
    previous = {signum: signal.getsignal(signum) for signum in PREEMPTION_SIGNALS}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.fixture
def one_thread():
    """One torch thread for a whole trainer in this process: a tiny model gains nothing from two, and with another
    process on the cores two threads spin against each other (an on-policy step of a 64-wide model took 2 s, not 0.05 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
