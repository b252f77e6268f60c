"""Process groups outside the default group, by backend name (the weight-sync transport's groups)."""

import datetime

import pytest
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.testing.distributed import free_port


def test_gloo_group_on_its_own_store_works_in_process():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    group = platform.new_process_group("gloo", store, 0, 1, datetime.timedelta(seconds=30))
    assert isinstance(group, dist.ProcessGroupGloo) and group.size() == 1


def test_nccl_group_gets_the_timeout_through_its_options(monkeypatch):
    built = []

    class FakeNCCL:  # the CPU build of torch has no ProcessGroupNCCL
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            built.append((store, rank, size, options._timeout))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    timeout = datetime.timedelta(seconds=7)
    assert isinstance(platform.new_process_group("nccl", "store", 1, 3, timeout), FakeNCCL)
    assert built == [("store", 1, 3, timeout)]


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'mpi' is not supported.*gloo.*hccl.*nccl"):
        platform.new_process_group("mpi", None, 0, 1, datetime.timedelta(seconds=1))
