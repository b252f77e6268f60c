"""The rollout engine's contract (:class:`RolloutEngine`): sampling with the student's current weights, taking new
weights between batches, and failing closed when an update fails part-way (:class:`StaleWeightsError`). Engines are
registered by name in :mod:`megatron_gkd.rollout.registry`."""

from __future__ import annotations

import abc
import functools
from typing import Iterable, Sequence

import torch

from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig


class StaleWeightsError(RuntimeError):
    """The engine does not hold one complete weight version (an update failed part-way): it refuses
    to generate until a complete update succeeds."""


def _refuse_when_stale(generate):
    @functools.wraps(generate)
    def guarded(self, *args, **kwargs):
        reason = getattr(self, "_stale_reason", None)
        if reason is not None:
            raise StaleWeightsError(f"{type(self).__name__} refuses to generate: {reason}; it generates again "
                                    "once a complete weight sync succeeds")
        return generate(self, *args, **kwargs)

    return guarded


def _fail_closed(load_weights):
    @functools.wraps(load_weights)
    def guarded(self, named_tensors, version: int):
        # Marked before the first tensor lands: an engine that loads in place (vLLM's reload) holds a
        # mix of two versions from then until the last tensor.
        self._stale_reason = f"the update to weight version {version} started and did not finish"
        try:
            load_weights(self, named_tensors, version)
        except BaseException as error:
            self._stale_reason = (f"the update to weight version {version} failed part-way ({type(error).__name__}: "
                                  f"{error}); its weights mix versions {self.weight_version} and {version}")
            raise
        self._stale_reason = None

    return guarded


class RolloutEngine(abc.ABC):
    """Samples responses with the student's current weights and takes new weights between batches.

    Subclasses call ``super().__init__(max_model_len, weight_version)``; :meth:`load_weights` is the one
    place weights change, and it sets :attr:`weight_version`, which every batch records.

    Fail closed: every subclass's ``load_weights`` marks the engine :attr:`stale` until it returns, so
    an update that fails part-way (a corrupted bucket, a dead sender, a reload error) leaves it stale,
    and its ``generate`` raises :class:`StaleWeightsError` naming the failed version until a complete
    update succeeds. :meth:`mark_stale` lets a weight receiver do the same (e.g. ``verify`` failed).
    """

    shares_student_weights: bool = False
    """The engine samples with the student's own parameters (nothing to send; a load sets the version)."""
    releases_weights: bool = False
    """The engine keeps no weights of its own between syncs (``rollout.release_weights``): it reads the tensors a
    load hands it in place, and the trainer calls :meth:`release_weights` before it changes them."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "generate" in cls.__dict__:
            cls.generate = _refuse_when_stale(cls.__dict__["generate"])
        if "load_weights" in cls.__dict__:
            cls.load_weights = _fail_closed(cls.__dict__["load_weights"])

    def __init__(self, max_model_len: int, weight_version: int = 0):
        self._max_model_len = max_model_len
        self._weight_version = weight_version
        self._stale_reason: str | None = None

    @property
    def weight_version(self) -> int:
        """Version of the weights in use (set by every complete weight load)."""
        return self._weight_version

    @property
    def stale(self) -> bool:
        """The weights are not one complete version; ``generate`` refuses until an update succeeds."""
        return getattr(self, "_stale_reason", None) is not None

    @property
    def stale_reason(self) -> str | None:
        """Why the engine is stale (names the failed version), or ``None``."""
        return getattr(self, "_stale_reason", None)

    def mark_stale(self, reason: str) -> None:
        """Refuses to generate until the next complete :meth:`load_weights` (``reason`` goes into the error)."""
        self._stale_reason = reason

    @property
    def max_model_len(self) -> int:
        """Longest prompt + response the engine accepts."""
        return self._max_model_len

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Samples ``sampling.n`` responses per prompt (prompt token ids; too-long prompts raise)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Loads HF-named tensors (any subset of the model's weights) and sets the weight version.

        The iterator is consumed exactly once (a weight receiver streams buckets through it).
        """
        raise NotImplementedError(f"rollout engine {type(self).__name__} cannot load weights")

    def release_weights(self) -> None:
        """Drops the engine's weights until the next complete :meth:`load_weights` (which restores them: a weight
        sync sends every weight); ``generate`` refuses meanwhile. Called before the trainer changes the tensors a
        load gave an engine that :attr:`releases_weights`."""
        raise NotImplementedError(f"rollout engine {type(self).__name__} cannot release its weights")

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Log-probs ``[sum(len(p) - 1)]`` (float64) of each prompt token after the first.

        What weight sync's ``verify`` compares with the student's own forward.
        """
        raise NotImplementedError(f"rollout engine {type(self).__name__} cannot score prompts")

    def close(self) -> None:  # noqa: B027 - a default: an engine without resources needs none
        """Releases the engine's resources."""
