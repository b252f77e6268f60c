"""Test-session setup: the platform is chosen before any test module imports Megatron-Core."""

import os

from megatron_gkd import platform

platform.setup(os.environ.get(platform.PLATFORM_ENV) or "cpu")
