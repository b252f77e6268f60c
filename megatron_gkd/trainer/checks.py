"""The checks the trainer's command line and the launcher run right after the config loads, beyond the config's
own: what resolves only by importing. (Registered names, ``trainer.scheduler`` and ``eval.scorer`` included, are
checked as the config loads: their registries sit below ``config/``.)"""

from __future__ import annotations

from megatron_gkd.rewards.kinds import REWARDS, load_function


def check_registered_names(config) -> None:
    """The user's ``module:function`` of ``eval.function`` and ``reward.function``, where the chosen kind reads one,
    imports and is callable: a typo fails here, not when the eval runs or the reward worker starts.

    Raises:
        ValueError: the module does not import, has no such attribute, or it is not callable; the message names
            the key.
    """
    for options, kind in ((config.eval, config.eval.scorer), (config.reward, config.reward.kind)):
        if kind is not None and "function" in REWARDS.get(kind).reads:
            try:
                load_function(options.function, key=f"{options.section}.function")
            except ImportError as error:  # the entry points report a config error (ValueError) in one line
                raise ValueError(str(error)) from error
