"""Loss tests run on tiny tensors: one intra-op thread avoids OpenMP spin-waits that make them ~10x
slower on a loaded 2-core machine. The previous setting is restored after each test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
