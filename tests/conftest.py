"""Test-session setup: the platform is chosen before any test module imports Megatron-Core; fixtures shared across
test folders."""

import os

import pytest
import torch

from megatron_gkd import platform

platform.setup(os.environ.get(platform.PLATFORM_ENV) or "cpu")


@pytest.fixture
def generators_made(monkeypatch) -> list:
    """Every ``torch.Generator`` made while the test runs, in order (each a few KB: sampling must not make one a
    response, issue #48)."""
    made = []

    class Counted(torch.Generator):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(torch, "Generator", Counted)
    return made
