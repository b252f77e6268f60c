"""The trainer's entry point with a rollout engine that takes every weight sync and keeps its first weights: what
vLLM 0.32 did to a tied student's head, one layer of it (``megatron_gkd/weight_sync/reload_logs.py``). Test only,
started from the repository root: ``torchrun ... -m tests.e2e.trainer.stale_engine --config ... key=value ...``."""

import sys

from megatron_gkd.rollout.hf_engine import HFEngine
from megatron_gkd.trainer import cli


def keep_first_weights(self, named_tensors, version: int) -> None:
    """Reads the whole stream, as a receiver does, and claims the new version without loading a tensor."""
    for _ in named_tensors:
        pass
    self._weight_version = int(version)


if __name__ == "__main__":
    HFEngine.load_weights = keep_first_weights
    sys.exit(cli.main())
