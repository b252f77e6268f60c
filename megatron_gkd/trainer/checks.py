"""The config checks that need the trainer's registries: ``config/`` sits below ``trainer/`` and does not
import it, so the trainer's command line and the launcher run these right after the config loads."""

from __future__ import annotations

from megatron_gkd.trainer.eval import SCORERS
from megatron_gkd.trainer.schedulers import SCHEDULERS


def check_registered_names(config) -> None:
    """``trainer.scheduler`` and ``eval.scorer`` name registered entries.

    Raises:
        ValueError: an unknown name, with the key, the closest registered name and all of them.
    """
    SCHEDULERS.get(config.trainer.scheduler)
    SCORERS.get(config.eval.scorer)
