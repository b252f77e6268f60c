"""Which prompts each step trains on: seeded per-epoch permutations with a resumable position."""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Global batches of dataset positions, identical on every rank.

    Epoch ``e`` visits the positions in a permutation that depends on ``(seed, e)`` only; batches are
    consecutive slices of it, and the epoch ends when fewer than ``batch_size`` positions remain (those
    are left out of that epoch, and a different permutation gives them their turn in the next).
    """

    def __init__(self, num_items: int, batch_size: int, *, shuffle: bool, seed: int):
        if seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {seed}")
        if batch_size < 1:
            raise ValueError(f"the prompt batch size must be >= 1, got {batch_size}")
        if num_items < batch_size:
            raise ValueError(f"the dataset holds {num_items} prompts, fewer than one batch of {batch_size}; use "
                             "more prompts (or a looser data.max_prompt_length) or a smaller batch")
        self._num_items = num_items
        self._batch_size = batch_size
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._position = 0  # next unused place in the current epoch's order
        self._order: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        """The epoch of the batch returned last (of the next batch before the first)."""
        return self._epoch

    def next_batch(self, count: int | None = None) -> list[int]:
        """The next ``count`` (default ``batch_size``) dataset positions; starts a new epoch when fewer than that
        remain (partial rollouts draw fewer than a batch to top theirs up)."""
        count = self._batch_size if count is None else count
        assert 0 < count <= self._num_items, f"cannot draw {count} of {self._num_items} prompts"
        if self._position + count > self._num_items:
            self._epoch += 1
            self._position = 0
            self._order = None
        batch = self._epoch_order()[self._position:self._position + count]
        self._position += count
        return batch.tolist()

    def state_dict(self) -> dict:
        """Everything needed to continue exactly here (plain JSON types)."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed, "shuffle": self._shuffle,
                "num_items": self._num_items, "batch_size": self._batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``, which must come from a sampler over the same data and batch size.

        Raises:
            ValueError: the number of prompts, the batch size, the seed or shuffling changed since the state
                was saved (the saved position would then point into a different order).
        """
        saved = {"num_items": self._num_items, "batch_size": self._batch_size, "seed": self._seed,
                 "shuffle": self._shuffle}
        changed = {key: (state.get(key, value), value) for key, value in saved.items()
                   if state.get(key, value) != value}
        if changed:
            described = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changed.items())
            raise ValueError(f"the prompt sampler's checkpoint does not match this run ({described}): resume with "
                             "the same prompt file, data filters, data.seed/shuffle and batch size, or start a "
                             "fresh run")
        position, epoch = int(state["position"]), int(state["epoch"])
        if not (0 <= position <= self._num_items and epoch >= 0):
            raise ValueError(f"corrupt prompt sampler state: epoch {epoch}, position {position} of {self._num_items}")
        self._epoch, self._position, self._order = epoch, position, None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self._shuffle:
                self._order = np.random.default_rng([self._seed, self._epoch]).permutation(self._num_items)
            else:
                self._order = np.arange(self._num_items)
        return self._order

