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


@pytest.fixture(params=["host_kernels", "torch_ops"])
def cross_vocab_paths(request, monkeypatch):
    """Runs a cross-tokenizer test on both ways of reading the map entries on the host: the numba kernels
    (megatron_gkd.losses.cross_vocab.kernels, used wherever they can be) and the torch operations (used on
    accelerators, for narrow logits, and without numba). Test modules opt in with
    ``pytestmark = pytest.mark.usefixtures("cross_vocab_paths")``."""
    from megatron_gkd.losses.cross_vocab import kernels as cross_vocab_kernels

    monkeypatch.setattr(cross_vocab_kernels, "ENABLED", request.param == "host_kernels")
    return request.param
