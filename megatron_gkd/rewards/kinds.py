"""Reward kinds: registered classes that turn a batch of responses into one float each (``reward.kind``), and
the eval's scorers (``eval.scorer`` chooses from the same registry, with the same options in the ``eval``
section): a reward and an eval score the same text the same way.

| kind | reward of one response | reads | records need |
|---|---|---|---|
| ``exact_match`` | 1 when the response is the answer (whitespace aside; the eval's default) | | ``answer`` |
| ``contains`` | 1 when the answer stands in the response as a whole word or number, any case | | ``answer`` |
| ``final_answer`` | 1 when the text after the last ``####`` is the answer (the demo's scorer) | | ``answer`` |
| ``math_answer`` | 1 when the last ``####`` / ``\\boxed{}`` answer is it (close numbers) | ``tolerance`` | ``answer`` |
| ``regex`` | 1 when ``pattern`` is found (with ``{answer}`` or ``(?P<answer>...)`` in it: the answer) | ``pattern`` | ``answer``, if read |
| ``function`` | what the user's ``module:function`` returns for the whole batch | ``function`` | |

``contains`` and ``regex`` read the answer as :mod:`megatron_gkd.rewards.matching` says (what is normalised, why
"12" is not found in "125").

Any kind may add a format reward: ``reward.format_coef`` when ``reward.format_pattern`` matches the response.

A kind says what it needs in class attributes (``required``, ``reads``, ``needs``); the config's checks and
the runner ask them, never compare names. A kind is called with the whole batch,
``kind(prompts, responses, records) -> sequence of floats``, and runs in the reward worker process
(:mod:`megatron_gkd.rewards.runner`): a plugin registers a class importable by its ``module:Class`` path::

    REWARDS.register("my_kind", "my_package.rewards:MyKind")   # a RewardKind subclass
"""

from __future__ import annotations

import abc
import importlib
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from megatron_gkd.registry import Registry
from megatron_gkd.rewards import answers, matching

REWARDS: Registry[type[RewardKind]] = Registry("reward kind", config_key="reward.kind")


class RewardKind(abc.ABC):
    """A batched reward, built from the ``reward`` section.

    Class attributes (what the config's checks and the runner ask):
        required: ``(option, hint)`` pairs: ``<section>.<option>`` must be set for this kind, the hint says how
            (``{section}`` in it: ``reward``, or ``eval`` for a scorer).
        reads: the scorer options this kind reads (:class:`~megatron_gkd.rewards.config.ScorerOptions`); the
            others, when set, are inert and logged as such.
        needs: record fields every record must hold (not None), e.g. ``("answer",)``; a record without one
            stops the run naming it, never scores 0 silently (:meth:`needs_for` when the options decide).

    Args:
        config: the ``reward`` section (:class:`~megatron_gkd.rewards.config.RewardConfig`), or the ``eval``
            section for ``eval.scorer``: both hold the scorer options and say the kind in ``kind``.
    """

    required: ClassVar[tuple[tuple[str, str], ...]] = ()
    reads: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any):
        self.config = config

    @classmethod
    def needs_for(cls, config: Any) -> tuple[str, ...]:
        """The record fields this kind needs with these options (``needs``, unless the options decide)."""
        return cls.needs

    @classmethod
    def describe(cls, config: Any) -> str:
        """How messages name this kind's reward under ``config`` (the kind; a user function's ``module:function``)."""
        return config.kind

    @property
    def name(self) -> str:
        return self.describe(self.config)

    @abc.abstractmethod
    def __call__(self, prompts: list[str], responses: list[str], records: list[dict]) -> Sequence[float]:
        """One reward per response, in order."""


class PerResponse(RewardKind):
    """A kind that scores each response on its own (the built-in verifiers)."""

    @abc.abstractmethod
    def score(self, response: str, record: dict) -> float:
        """The reward of one response."""

    def __call__(self, prompts, responses, records):
        return [self.score(response, record) for response, record in zip(responses, records)]


class AgainstAnswer(PerResponse):
    """A verifier that compares each response with ``record["answer"]`` (as text: a record's answer may be an
    integer) by its ``compare(response, answer) -> float``."""

    needs = ("answer",)
    compare: ClassVar[Callable[[str, str], float]]

    def score(self, response, record):
        return type(self).compare(response, str(record["answer"]))


@REWARDS.register("exact_match")
class ExactMatch(AgainstAnswer):
    """:func:`~megatron_gkd.rewards.matching.exact_match`: the whole response is the answer."""

    compare = staticmethod(matching.exact_match)


@REWARDS.register("contains")
class Contains(AgainstAnswer):
    """:func:`~megatron_gkd.rewards.matching.contains`: the answer as a whole word or number in a chatty response
    ("The capital of France is Paris.")."""

    compare = staticmethod(matching.contains)


@REWARDS.register("final_answer")
class FinalAnswer(AgainstAnswer):
    """The demo's verifier: :func:`~megatron_gkd.rewards.answers.final_answer`, the text after the last ``####``."""

    compare = staticmethod(answers.final_answer)


@REWARDS.register("math_answer")
class MathAnswer(PerResponse):
    """``####`` or ``\\boxed{}`` answers compared as numbers within ``reward.tolerance``
    (:func:`~megatron_gkd.rewards.answers.math_answer`); the reference may be a whole GSM8K solution."""

    reads = ("tolerance",)
    needs = ("answer",)

    def score(self, response, record):
        return answers.math_answer(response, str(record["answer"]), self.config.tolerance)


@REWARDS.register("regex")
class RegexReward(PerResponse):
    """The section's ``pattern`` (:class:`~megatron_gkd.rewards.matching.AnswerPattern`): found in the response;
    with ``{answer}`` in it, found with the answer there; with a group ``(?P<answer>...)``, its last match's group
    is the answer. Flags inline, e.g. ``(?s)``."""

    required = (("pattern", "a regular expression; 1.0 where re.search finds it in the response, with {{answer}} in it "
                            "standing for the record's answer, or a group (?P<answer>...) read as the answer, e.g. "
                            "{section}.pattern='answer is:? {{answer}}' (on the command line, quote a pattern that starts "
                            "with '#', which YAML reads as a comment: {section}.pattern='\"####\"')"),)
    reads = ("pattern",)

    def __init__(self, config):
        super().__init__(config)
        self.pattern = matching.AnswerPattern(config.pattern)

    @classmethod
    def needs_for(cls, config):
        return ("answer",) if matching.AnswerPattern(config.pattern).reads_answer else ()

    def score(self, response, record):
        answer = record.get("answer")
        return self.pattern(response, None if answer is None else str(answer))


@REWARDS.register("function")
class FunctionReward(RewardKind):
    """The user's ``function`` (``reward.function``, ``eval.function``), ``module:function``, imported by name and
    called with the whole batch:
    ``fn(prompts: list[str], responses: list[str], records: list[dict]) -> sequence of floats``."""

    required = (("function", "the reward as module:function, importable from the trainer's Python path, e.g. "
                             "{section}.function=my_rewards:score"),)
    reads = ("function",)

    def __init__(self, config):
        super().__init__(config)
        self.function = load_function(config.function, key=f"{config.section}.function")

    @classmethod
    def describe(cls, config):
        return config.function

    def __call__(self, prompts, responses, records):
        return self.function(prompts, responses, records)


class WithFormat(RewardKind):
    """A kind's reward plus ``format_coef`` where ``format_pattern`` is found in the response (not registered:
    :func:`build_reward` adds it when ``reward.format_pattern`` is set)."""

    def __init__(self, inner: RewardKind, pattern: str, coef: float):
        super().__init__(inner.config)
        self.inner, self.pattern, self.coef = inner, re.compile(pattern), coef

    @property
    def name(self) -> str:
        return f"{self.inner.name} + format"

    def __call__(self, prompts, responses, records):
        values = self.inner(prompts, responses, records)
        if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):  # numpy / torch
            values = values.tolist()
        if not isinstance(values, Sequence) or len(values) != len(responses):
            return values  # wrong shape: the runner reports the inner function's result as it is
        # A value that is not a number is left as it is, for the runner to report.
        return [value + self.coef * (self.pattern.search(response) is not None)
                if isinstance(value, numbers.Real) else value for value, response in zip(values, responses)]


def load_function(target: str, key: str = "reward.function") -> Callable[..., Any]:
    """The callable ``module:function`` (``function`` may be dotted: ``module:Class.method``); ``key``, the option
    that names it, for messages.

    Raises:
        ValueError: ``target`` is not ``module:function``, the attribute is missing or not callable.
        ImportError: the module does not import (its own error, chained).
    """
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{key}={target!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"{key}={target!r}: module {module_name!r} does not import ({error}); "
                          "put it on PYTHONPATH or install its package") from error
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}={target!r}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}={target!r} is not callable (a {type(obj).__name__})")
    return obj


def kind_target(kind: str) -> str:
    """``"module:Class"`` of the class registered as ``kind``: how the worker process finds it (a plugin kind
    registered in the trainer's process alone would be unknown there)."""
    cls = REWARDS.get(kind)
    return f"{cls.__module__}:{cls.__qualname__}"


def build_reward(config: Any) -> RewardKind:
    """The reward of the ``reward`` section: its kind, plus the format reward when ``format_pattern`` is set.

    Raises:
        ValueError: unknown kind, or the kind's own errors (a user function that does not import...).
    """
    reward = REWARDS.get(config.kind)(config)
    if config.format_pattern is not None:
        reward = WithFormat(reward, config.format_pattern, config.format_coef)
    return reward


def reward_name(config: Any) -> str:
    """How messages name the section's reward, without building it (no user module is imported)."""
    name = REWARDS.get(config.kind).describe(config)
    return f"{name} + format" if config.format_pattern is not None else name
