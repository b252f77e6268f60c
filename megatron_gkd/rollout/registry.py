"""Rollout engines registered by name and chosen by a config string.

``build_engine("vllm", model=..., layout="colocated")`` or ``build_engine("megatron", chunks=...)``.
Every engine implements :class:`RolloutEngine`.
"""

from __future__ import annotations

import abc
from typing import Callable, Sequence

from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig

_ENGINES: dict[str, Callable[..., "RolloutEngine"]] = {}


class RolloutEngine(abc.ABC):
    """Samples responses with the student's current weights.

    Subclasses call ``super().__init__(max_model_len, weight_version)`` and bump ``_weight_version``
    whenever new weights are in use.
    """

    def __init__(self, max_model_len: int, weight_version: int = 0):
        self._max_model_len = max_model_len
        self._weight_version = weight_version

    @property
    def weight_version(self) -> int:
        """Version of the weights in use (bumped by every weight load)."""
        return self._weight_version

    @property
    def max_model_len(self) -> int:
        """Longest prompt + response the engine accepts."""
        return self._max_model_len

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Samples ``sampling.n`` responses per prompt (prompt token ids; too-long prompts raise)."""

    def close(self) -> None:
        """Releases the engine's resources."""


def register_engine(name: str) -> Callable:
    """Class/function decorator registering an engine factory under ``name``."""

    def register(factory):
        if name in _ENGINES:
            raise ValueError(f"rollout engine {name!r} is registered twice")
        _ENGINES[name] = factory
        return factory

    return register


def build_engine(name: str, **kwargs) -> RolloutEngine:
    """Builds the engine registered as ``name`` with ``kwargs``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names).
    """
    if name not in _ENGINES:
        raise ValueError(f"rollout.engine={name!r} is unknown; choose one of {sorted(_ENGINES)}")
    return _ENGINES[name](**kwargs)


def registered_engines() -> list[str]:
    return sorted(_ENGINES)
