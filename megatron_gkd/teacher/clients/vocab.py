"""Start-up vocabulary checks between teacher and student.

Embedding tables are often padded past the tokenizer (Qwen: 151936 vs 152064 rows); those extra ids are
never real tokens. Teacher and student agree when their tokenizers map the same strings to the same
ids; then ids at or past the tokenizer's size are ignored (dropped from the teacher's top-k with a log
line). Different tokenizers are an error (a divergence over mismatched ids is meaningless) unless the run asks for
cross-tokenizer distillation (``teacher.cross_tokenizer.method``, :mod:`megatron_gkd.xtok`): then the teacher's ids
are its own vocabulary's, and ids at or past the teacher's tokenizer size are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.teacher.protocol.types import TeacherOutput
from megatron_gkd.xtok.config import CrossTokenizerConfig, check_tokenizers

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class VocabAlignment:
    """Result of the start-up check.

    Attributes:
        real_vocab_size: ids below this are real tokens on both sides; teacher ids at or past it
            are dropped from outputs.
        teacher_vocab_size: rows of the teacher's output layer.
        student_vocab_size: rows of the student's output layer.
        cross: the teacher's tokenizer is another (cross-tokenizer distillation): ``real_vocab_size`` is the
            teacher tokenizer's size, and teacher ids never index the student's vocabulary.
    """

    real_vocab_size: int
    teacher_vocab_size: int
    student_vocab_size: int
    cross: bool = False


def check_vocab(*, teacher_vocab_size: int, teacher_tokenizer_size: int, teacher_digest: str,
                student_vocab_size: int, student_tokenizer: Any, cross_tokenizer=None) -> VocabAlignment:
    """Compares teacher and student vocabularies.

    Args:
        teacher_vocab_size, teacher_tokenizer_size, teacher_digest: from the teacher's INFO
            (:class:`~megatron_gkd.teacher.backends.BackendInfo`).
        student_vocab_size: rows of the student's (possibly padded) output layer.
        student_tokenizer: the student's HF tokenizer.
        cross_tokenizer: the teacher's :class:`~megatron_gkd.xtok.config.CrossTokenizerConfig` (None: unset).

    Raises:
        ValueError: the tokenizers differ and the run did not ask for cross-tokenizer distillation (the message
            names the key that does), or a tokenizer defines ids past its embedding table.
    """

    student_size, student_digest = len(student_tokenizer), tokenizer_digest(student_tokenizer)
    same = (student_size, student_digest) == (teacher_tokenizer_size, teacher_digest)
    cross = check_tokenizers(cross_tokenizer or CrossTokenizerConfig(), student_digest=student_digest,
                             teacher_digest=teacher_digest if same else f"{teacher_digest}/{teacher_tokenizer_size}")
    if cross:
        if teacher_vocab_size < teacher_tokenizer_size:
            raise ValueError(f"the teacher's output layer has {teacher_vocab_size} rows but its tokenizer defines "
                             f"{teacher_tokenizer_size} ids; the checkpoint does not belong to its tokenizer")
        logger.info("cross-tokenizer teacher: %d-id tokenizer (digest %s), student %d ids (digest %s)",
                    teacher_tokenizer_size, teacher_digest[:12], student_size, student_digest[:12])
        return VocabAlignment(real_vocab_size=teacher_tokenizer_size, teacher_vocab_size=teacher_vocab_size,
                              student_vocab_size=student_vocab_size, cross=True)
    for side, rows in (("teacher", teacher_vocab_size), ("student", student_vocab_size)):
        if rows < student_size:
            raise ValueError(f"the {side} output layer has {rows} rows but the tokenizer defines "
                             f"{student_size} ids; the checkpoint does not belong to this tokenizer")
    if teacher_vocab_size != student_vocab_size or teacher_vocab_size != student_size:
        logger.info("vocabularies padded: teacher %d rows, student %d rows, tokenizer %d ids; teacher "
                    "ids >= %d are ignored", teacher_vocab_size, student_vocab_size, student_size,
                    student_size)
    return VocabAlignment(real_vocab_size=student_size, teacher_vocab_size=teacher_vocab_size,
                          student_vocab_size=student_vocab_size)


def restrict_to_vocab(output: TeacherOutput, real_vocab_size: int) -> TeacherOutput:
    """Drops top-k entries with ids >= ``real_vocab_size`` (padding rows), keeping rows sorted.

    Dropped slots are refilled at the end of the row with id 0 and log-prob ``-inf`` (zero
    probability, which the losses treat as absent), never with log-prob 0.
    """
    padded = output.topk_ids >= real_vocab_size
    if not padded.any():
        return output
    order = np.argsort(padded, axis=1, kind="stable")  # real entries first, in their sorted order
    ids = np.take_along_axis(output.topk_ids, order, axis=1)
    logprobs = np.take_along_axis(output.topk_logprobs, order, axis=1)
    dropped = np.take_along_axis(padded, order, axis=1)
    ids[dropped], logprobs[dropped] = 0, -np.inf
    return dataclasses.replace(output, topk_ids=ids, topk_logprobs=logprobs)
