"""Tiny assets (a random teacher and student sharing a tokenizer, prompt files) for the trainer's e2e tests."""

import pytest

from megatron_gkd.testing import runs as harness


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_assets

    return build_assets(tmp_path_factory.mktemp("tiny_assets"))


@pytest.fixture(scope="session")
def sync_run(assets, tmp_path_factory):
    """20 sync steps, deterministic, a checkpoint every step (the resume test reuses it)."""
    out = tmp_path_factory.mktemp("sync") / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + harness.SYNC_RUN)
    assert code == 0, log[-4000:]
    return out, log
