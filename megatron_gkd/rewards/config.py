"""The ``reward`` section, and the checks between rewards, ``rollout.n`` and the advantage estimator.

A run without ``reward.kind`` computes no reward. With one, every sampled response gets a reward from the
kind (:mod:`megatron_gkd.rewards.kinds`) in a worker process, beside the teacher request
(:mod:`megatron_gkd.rewards.runner`); a reward that fails stops the run after its last complete step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Protocol

from megatron_gkd.rewards.kinds import REWARDS

logger = logging.getLogger(__name__)

# Options that only some kinds read (each kind lists its own in ``reads``).
_KIND_OPTIONS = ("function", "pattern", "tolerance")


@dataclasses.dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Rewards of sampled responses: a verifier or the user's function (see the kinds' table in
    :mod:`megatron_gkd.rewards.kinds`)."""

    kind: str | None = None
    """Registered reward kind: ``final_answer`` (the demo's), ``math_answer``, ``regex`` or ``function``; null: no
    reward is computed."""
    function: str | None = None
    """``kind=function``: the reward as ``module:function``, called with the batch as
    ``fn(prompts: list[str], responses: list[str], records: list[dict]) -> sequence of floats``; imported in the
    reward worker with the trainer's Python path."""
    pattern: str | None = None
    """``kind=regex``: a regular expression; the reward is 1.0 where ``re.search`` finds it in the response. On the
    command line, quote one that starts with ``#`` (YAML reads it as a comment, null): ``reward.pattern='"####"'``."""
    tolerance: float = 1e-6
    """``kind=math_answer``: numbers are equal within ``tolerance * max(1, |answer|)``."""
    format_pattern: str | None = None
    """An optional format reward for any kind: ``format_coef`` is added where this regular expression is found
    in the response (e.g. ``'####'``, or ``'\\\\boxed\\{'``)."""
    format_coef: float = 0.1
    """The format reward's size (the verifiers give 0 or 1)."""
    timeout_s: float = 60.0
    """Longest one batch's rewards may take in the worker; past it the worker is killed and the run stops
    naming the reward and the batch's records."""
    start_timeout_s: float = 120.0
    """Longest the worker may take to start and build the reward (importing the user's module included)."""

    def __post_init__(self):
        if self.kind is None:
            named = [key for key in ("function", "pattern", "format_pattern") if getattr(self, key) is not None]
            if named:
                raise ValueError(f"reward.{named[0]} is set but reward.kind is null, so no reward is computed: set "
                                 f"reward.kind ({', '.join(map(repr, REWARDS.names()))}) or drop reward.{named[0]}")
        else:
            kind = REWARDS.get(self.kind)  # unknown: ValueError with the closest name
            for option, hint in kind.required:
                if getattr(self, option) is None:
                    raise ValueError(f"reward.kind={self.kind!r} needs reward.{option}: {hint}")
            for option in _KIND_OPTIONS:
                if option not in kind.reads and getattr(self, option) != _default(option):
                    logger.warning("reward.%s=%r has no effect with reward.kind=%r", option, getattr(self, option),
                                   self.kind)
        if self.function is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.function):
            raise ValueError(f"reward.function={self.function!r} must look like 'package.module:function'")
        for key in ("pattern", "format_pattern"):
            if getattr(self, key) is not None:
                pattern = getattr(self, key)
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ValueError(f"reward.{key}={pattern!r} is not a regular expression: {error}") from None
        if not (self.tolerance >= 0 and math.isfinite(self.tolerance)):
            raise ValueError(f"reward.tolerance={self.tolerance} must be a finite number >= 0")
        if not math.isfinite(self.format_coef):
            raise ValueError(f"reward.format_coef={self.format_coef} must be finite")
        if self.format_pattern is None and self.format_coef != _default("format_coef"):
            logger.warning("reward.format_coef=%s has no effect without reward.format_pattern", self.format_coef)
        for key in ("timeout_s", "start_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"reward.{key}={getattr(self, key)} must be > 0 seconds")

    @property
    def enabled(self) -> bool:
        """Rewards are computed (``reward.kind`` is set)."""
        return self.kind is not None


def _default(option: str):
    return next(field.default for field in dataclasses.fields(RewardConfig) if field.name == option)


class Estimator(Protocol):
    """What :func:`check_reward_settings` asks an advantage estimator (the registered estimator of the
    policy-gradient term, e.g. ``losses.advantages.AdvantageEstimator``; asked, never compared by name)."""

    name: str
    min_group_size: int
    """Fewest samples per prompt it is defined for (a baseline from the other samples of the prompt needs 2)."""


def check_reward_settings(reward: RewardConfig, rollout_n: int, advantage: Estimator | None, *,
                          advantage_key: str = "advantage") -> None:
    """Checks the reward section against the sampling and the advantage estimator.

    Args:
        reward: the ``reward`` section.
        rollout_n: samples per prompt (``rollout.n``).
        advantage: the estimator of the policy-gradient term, or None when nothing trains on the rewards (they
            are then only measured).
        advantage_key: the config key that chose the estimator, for messages.

    Raises:
        ValueError: an estimator with a group baseline and ``rollout.n`` below its group size (GRPO with
            ``rollout.n=1`` has no group to compare with: every advantage would be 0), or with no reward to
            compare (a reward without a verifier: every reward 0, every advantage 0). An estimator without a
            baseline (REINFORCE) may run without a reward, its signal coming from elsewhere. Each message names
            the keys and the fix.
    """
    if advantage is None:
        return
    group = advantage.min_group_size
    if group >= 2 and not reward.enabled:
        raise ValueError(f"{advantage_key}={advantage.name!r} compares the rewards of each prompt's samples, but "
                         f"reward.kind is null (a reward without a verifier: every advantage would be 0): set "
                         f"reward.kind to a verifier ({', '.join(map(repr, REWARDS.names()))}; 'function' with "
                         "reward.function=module:function for your own)")
    if rollout_n < group:
        raise ValueError(f"{advantage_key}={advantage.name!r} compares the rollout.n samples of each prompt with each "
                         f"other, so it needs rollout.n >= {group}, got rollout.n={rollout_n} (every advantage would "
                         f"be 0): set rollout.n={max(4, group)} or more")
