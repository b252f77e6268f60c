"""The exponential moving average of the student's weights that a self teacher reads (``teacher.self_weights=ema``).

After every optimizer step, ``ema = decay * ema + (1 - decay) * weights`` for every parameter of this rank's shards,
starting from the initial weights. The EMA is a model of its own: the student's HF checkpoint loaded again on the same
layout (TP/EP, as ``self_weights=initial``'s frozen copy), in float32 whatever the student's dtype (a bf16 average
with decay 0.99 would round away most of each step's ``0.01 * weights``), in eval mode and without gradient. The self
teacher scores with it as with the student's own chunks.

Its cost is the student's parameters once more per rank in float32 (no gradients, no optimizer state) and one
``mul_``/``add_`` pass over them per optimizer step. It is saved in the run's checkpoints under the teacher's key
(``teacher_ema`` or ``teacher_ema.NAME``) and restored on resume, so a resumed run's teacher is the uninterrupted
run's (:mod:`megatron_gkd.trainer.checkpointing`).
"""

from __future__ import annotations

import logging

import torch

from megatron_gkd.models import unwrap
from megatron_gkd.trainer.components import frozen_copy, parameter_mib

logger = logging.getLogger(__name__)


class WeightsEMA:
    """An EMA of the student's parameters on this rank, kept as model chunks sharded like the student's.

    Args:
        student: the :class:`~megatron_gkd.trainer.components.Student` (its chunks, checkpoint and layout).
        decay: the weight of the past per optimizer step (``teacher.ema_decay``), in (0, 1).
        key: its name in the run's checkpoints.
    """

    def __init__(self, student, decay: float, key: str):
        assert 0.0 < decay < 1.0, decay  # TeacherConfig checks it
        self.decay, self.key = decay, key
        self.chunks = frozen_copy(student, torch.float32)
        self._averages, self._weights = _paired_parameters(self.chunks, student.chunks)
        logger.info("self teacher: an EMA of the student's weights (decay %g, from %s), %.1f MiB on this rank", decay,
                    student.checkpoint, parameter_mib(self.chunks))

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after an optimizer step (``.float()`` is no copy for a float32 student)."""
        torch._foreach_mul_(self._averages, self.decay)
        torch._foreach_add_(self._averages, [weight.float() for weight in self._weights], alpha=1.0 - self.decay)


def _paired_parameters(averages: list, students: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The EMA's parameters and the student's, in the same order, matched by name within each chunk."""
    assert len(averages) == len(students), (len(averages), len(students))
    pairs_average, pairs_student = [], []
    for average, student in zip(averages, students, strict=True):
        own, theirs = dict(unwrap(average).named_parameters()), dict(unwrap(student).named_parameters())
        assert own.keys() == theirs.keys(), sorted(own.keys() ^ theirs.keys())
        for name, parameter in own.items():
            assert parameter.shape == theirs[name].shape, (name, parameter.shape, theirs[name].shape)
            pairs_average.append(parameter)
            pairs_student.append(theirs[name])
    return pairs_average, pairs_student
