"""The ``reward`` section, the scorer options it shares with the ``eval`` section, and the checks between
rewards, ``rollout.n`` and the advantage estimator.

A run without ``reward.kind`` computes no reward. With one, every sampled response gets a reward from the
kind (:mod:`megatron_gkd.rewards.kinds`) in a worker process, beside the teacher request
(:mod:`megatron_gkd.rewards.runner`); a reward that fails stops the run after its last complete step.
``eval.scorer`` chooses from the same kinds, with the same options (:class:`ScorerOptions`) checked by the same
:func:`check_scorer`: a reward and an eval read an answer alike.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import ClassVar, Protocol

from megatron_gkd.rewards.kinds import REWARDS
from megatron_gkd.rewards.matching import AnswerPattern

logger = logging.getLogger(__name__)

# The largest |reward| accepted by default: verifiers give 0 or 1, graders a few points. A finite 1e308 is a grader's
# bug, and an estimator's arithmetic on such rewards (GRPO's mean of two) overflows to inf and NaN.
DEFAULT_MAX_ABS = 1e6


@dataclasses.dataclass(kw_only=True, slots=True)
class ScorerOptions:
    """The options a kind reads besides its name (each kind lists its own in ``reads``): the same keys in the
    ``reward`` section and the ``eval`` section, so that ``reward.kind=regex reward.pattern=P`` and
    ``eval.scorer=regex eval.pattern=P`` score alike."""

    section: ClassVar[str]
    """The section's name, for messages (``reward``, ``eval``)."""
    choice_key: ClassVar[str]
    """The key that chooses the kind (``reward.kind``, ``eval.scorer``)."""

    function: str | None = None
    """``function``: the score as ``module:function``, called with the batch as
    ``fn(prompts: list[str], responses: list[str], records: list[dict]) -> sequence of floats`` (a record holds
    ``index``, ``answer`` and ``group``)."""
    pattern: str | None = None
    """``regex``: a regular expression, 1.0 where ``re.search`` finds it in the response. ``{answer}`` in it stands
    for the record's answer (found as ``contains`` finds it); a group ``(?P<answer>...)`` is read as the answer
    (its last match, compared as ``contains`` compares). On the command line, quote one that starts with ``#`` or
    ``{`` (YAML reads a comment, null, or a mapping): ``reward.pattern='"####"'``."""
    tolerance: float = 1e-6
    """``math_answer``: numbers are equal within ``tolerance * max(1, |answer|)``."""


def check_scorer(options: ScorerOptions, kind_name: str) -> None:
    """Checks the kind ``kind_name`` that ``options.choice_key`` chose, and the options it reads.

    Raises:
        ValueError: an unknown kind (with the closest name), a required option unset, a ``function`` that is not
            ``module:function``, a ``pattern`` that does not compile, a ``tolerance`` below 0; each names the key.
    """
    section, key = options.section, options.choice_key
    kind = REWARDS.get(kind_name, config_key=key)
    for option, hint in kind.required:
        if getattr(options, option) is None:
            raise ValueError(f"{key}={kind_name!r} needs {section}.{option}: {hint.format(section=section)}")
    for option in (field.name for field in dataclasses.fields(ScorerOptions)):
        value = getattr(options, option)
        if option not in kind.reads and value != _default(option):
            logger.warning("%s.%s=%r has no effect with %s=%r", section, option, value, key, kind_name)
    if options.function is not None and not re.fullmatch(r"[\w.]+:[\w.]+", options.function):
        raise ValueError(f"{section}.function={options.function!r} must look like 'package.module:function'")
    if options.pattern is not None:
        try:
            AnswerPattern(options.pattern)
        except ValueError as error:
            raise ValueError(f"{section}.pattern={error}") from None
    if not (options.tolerance >= 0 and math.isfinite(options.tolerance)):
        raise ValueError(f"{section}.tolerance={options.tolerance} must be a finite number >= 0")


@dataclasses.dataclass(kw_only=True, slots=True)
class RewardConfig(ScorerOptions):
    """Rewards of sampled responses: a verifier or the user's function (see the kinds' table in
    :mod:`megatron_gkd.rewards.kinds`); the options it shares with ``eval``: :class:`ScorerOptions`."""

    section: ClassVar[str] = "reward"
    choice_key: ClassVar[str] = "reward.kind"

    kind: str | None = None
    """Registered reward kind: ``exact_match``, ``contains``, ``final_answer`` (the demo's), ``math_answer``,
    ``regex`` or ``function``; null: no reward is computed. A user's ``function`` is imported in the reward worker
    with the trainer's Python path."""
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
    max_abs: float = DEFAULT_MAX_ABS
    """Largest ``|reward|`` accepted: a reward past it (or not finite) stops the run naming the reward and its
    record, as a failed reward does. Raise it for a reward of a larger scale; the advantage estimators refuse what
    overflows anyway."""

    def __post_init__(self):
        if self.kind is None:
            named = [key for key in ("function", "pattern", "format_pattern") if getattr(self, key) is not None]
            if named:
                raise ValueError(f"reward.{named[0]} is set but reward.kind is null, so no reward is computed: set "
                                 f"reward.kind ({', '.join(map(repr, REWARDS.names()))}) or drop reward.{named[0]}")
        else:
            check_scorer(self, self.kind)
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern)
            except re.error as error:
                raise ValueError(f"reward.format_pattern={self.format_pattern!r} is not a regular expression: "
                                 f"{error}") from None
        if not math.isfinite(self.format_coef):
            raise ValueError(f"reward.format_coef={self.format_coef} must be finite")
        if self.format_pattern is None and self.format_coef != _default("format_coef"):
            logger.warning("reward.format_coef=%s has no effect without reward.format_pattern", self.format_coef)
        if not (math.isfinite(self.max_abs) and self.max_abs > 0):
            raise ValueError(f"reward.max_abs={self.max_abs} must be a finite number > 0")
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
