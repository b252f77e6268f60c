"""The multi-process harness returns per-rank results and reports failures with the rank's traceback."""

import pytest
import torch
import torch.distributed as dist

from megatron_gkd.testing.distributed import DistributedFailure, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_rank(scale: int):
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), float(value) * scale


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes; the harness must not hang


def _hang():
    import time

    time.sleep(60)


def test_results_come_back_by_rank():
    assert run_distributed(_all_reduce_rank, 2, args=(10,)) == [(0, 30.0), (1, 30.0)]


def test_failure_carries_the_rank_and_traceback():
    with pytest.raises(DistributedFailure, match="failed on rank 1") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=120)
    assert "ValueError: rank one is broken" in str(info.value)


def test_timeout_names_the_ranks():
    with pytest.raises(DistributedFailure, match=r"ranks \[0\] did not finish within 3 s"):
        run_distributed(_hang, 1, timeout=3)
