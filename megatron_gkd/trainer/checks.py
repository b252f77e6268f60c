"""The config checks that need the trainer's registries: ``config/`` sits below ``trainer/`` and does not
import it, so the trainer's command line and the launcher run these right after the config loads. (The schedulers'
registry is the config's own, ``config/schedules.py``: ``trainer.scheduler`` is checked as the config loads.)"""

from __future__ import annotations

from megatron_gkd.trainer.eval import SCORERS


def check_registered_names(config) -> None:
    """``eval.scorer`` names a registered entry.

    Raises:
        ValueError: an unknown name, with the key, the closest registered name and all of them.
    """
    SCORERS.get(config.eval.scorer)
