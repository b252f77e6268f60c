"""Schedulers: how far batch production runs ahead of the update that trains it, around futures.

A batch is produced (prompts drawn, responses sampled, the teacher asked) by a callback that returns at
once with futures where work can overlap: teacher scoring always, rollout too when it runs on a rollout
server. Before update ``i`` the pipeline tops up its queue to batches ``i .. i + max_staleness`` and
hands back batch ``i``, so the batches ahead are sampled with the weights before update ``i`` and their
teacher scoring (and, disaggregated, rollout) runs while update ``i`` does:

=================  ================================================================  ===========
``sync``           rollout(i), teacher(i), update(i), sync                           staleness 0
``one_step_off``   batch i+1 sampled, sent to the teacher, before update(i)          staleness 1
``two_step_off``   two batches in flight                                             staleness 2
``partial``        rollout(i) in token chunks; unfinished samples carried to i+1     per token
=================  ================================================================  ===========

``partial`` produces each batch just before its update, as ``sync`` does, but its rollout runs each sample at most
``rollout.partial.chunk_tokens`` new tokens a round and keeps the unfinished ones for the next step, which continues
them with the new weights (:mod:`.partial`): a batch holds tokens of several weight versions, each recorded.
``partial_one_step_off`` produces them one update ahead, as ``one_step_off`` does, so the teacher scores a batch while
the previous update runs.

Warm-up trains what is in flight (staleness grows from 0); the end drains it: only batches that will be
trained are produced, each exactly once.

The schedules themselves (name, ``max_staleness``, ``partial``) are registered in
:data:`megatron_gkd.config.schedules.SCHEDULERS`, where the config's checks can ask them too.
"""

from __future__ import annotations

import collections
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class BatchPipeline(Generic[T]):
    """Batches ``start .. num_batches - 1`` produced ``max_staleness`` ahead and handed out in order.

    Args:
        produce: ``produce(index)`` starts batch ``index`` and returns its handle (with futures inside).
        max_staleness: batches in flight beyond the one being trained.
        start: the first batch index (a resumed run starts past the trained ones).
        num_batches: batches of the whole run.
    """

    def __init__(self, produce: Callable[[int], T], *, max_staleness: int, start: int, num_batches: int):
        self._produce = produce
        self.max_staleness = max_staleness
        self._next = start
        self._num_batches = num_batches
        self._queue: collections.deque[tuple[int, T]] = collections.deque()
        self.num_produced = 0

    def next(self) -> tuple[int, T]:
        """Tops the queue up, then returns ``(index, handle)`` of the oldest batch."""
        while len(self._queue) <= self.max_staleness and self._next < self._num_batches:
            self._queue.append((self._next, self._produce(self._next)))
            self._next += 1
            self.num_produced += 1
        if not self._queue:
            raise StopIteration("every batch of the run has been handed out")
        return self._queue.popleft()

    @property
    def num_sampled(self) -> int:
        """Batch indices produced so far (in flight or trained), counted from the run's first batch."""
        return self._next

    @property
    def in_flight(self) -> list[tuple[int, T]]:
        """Produced but not yet handed out (oldest first)."""
        return list(self._queue)
