"""Shared fixtures of the trainer's unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def gloo_world(tmp_path_factory):
    """A gloo world of one process for the module's tests (collectives of the trainer's parts run on it at once)."""
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
