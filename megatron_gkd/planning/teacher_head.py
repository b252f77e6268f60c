"""The teacher's output layer on the student ranks (``teacher.signal=hidden``), as the planner counts it.

With the hidden signal the teacher sends its final hidden states (after the last norm) and every rank
of the student's last pipeline stage recomputes the teacher's logits for its own vocabulary shard. It
holds the rows of the teacher's output layer that its shard of the student's table covers: a frozen
``[V_student / tp, h_teacher]`` tensor in the student's parameter dtype (no gradient, no optimizer
state), split along the vocabulary exactly like the student's own output layer. Rows the teacher's
table lacks (a student table longer than the teacher's) are zeros; see
:func:`megatron_gkd.models.teacher_head.load_teacher_head`, which reads only these rows.

Only the teacher's ``config.json`` is read here (no torch, no weights), so a dry run on a laptop can
plan a 671B teacher from ``configs/hf/deepseek-v3``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from megatron_gkd.planning.layout import DTYPE_BYTES
from megatron_gkd.planning.model import read_config

HIDDEN_LOSS_CHUNK_BUFFERS = 3
"""float32 ``[chunk_size, V/tp]`` buffers the hidden-signal loss holds at once beyond the student's gradients:
the student's and the teacher's logits of one token chunk (the student's become its gradient in place) and
about one more of temporaries. Measured by ``benchmarks/teacher_signal.py`` (V=151,936, TP=2, chunk 256):
233 MiB per rank above the gradients = 3.1 buffers of 74 MiB (docs/performance.md)."""

HIDDEN_LOSS_BUFFER_BYTES = 4  # the chunk buffers are float32 whatever the parameter dtype
TEACHER_HIDDEN_BYTES = 4  # the client hands hidden states over as float32 (docs/teacher_protocol.md)


class TeacherHeadShape(NamedTuple):
    """The teacher's output layer as its ``config.json`` describes it: ``(vocab_size, hidden_size, tied)``."""

    vocab_size: int
    """Rows of the teacher's output layer (its config's ``vocab_size``, padding rows included)."""
    hidden_size: int
    """Columns: the teacher's hidden size, the length of every hidden state it sends."""
    tied: bool
    """The output layer is the input embedding (``tie_word_embeddings``): read from ``embed_tokens``."""

    @classmethod
    def from_config(cls, hf_config: dict) -> "TeacherHeadShape":
        """The head of an HF ``config.json`` dict.

        Raises:
            ValueError: ``vocab_size`` or ``hidden_size`` is missing or not positive.
        """
        missing = [key for key in ("vocab_size", "hidden_size") if hf_config.get(key) is None]
        if missing:
            raise ValueError(f"the teacher's HF config lacks {' and '.join(missing)}")
        vocab_size, hidden_size = int(hf_config["vocab_size"]), int(hf_config["hidden_size"])
        if vocab_size < 1 or hidden_size < 1:
            raise ValueError(f"the teacher's HF config has vocab_size={vocab_size}, hidden_size={hidden_size}")
        return cls(vocab_size, hidden_size, bool(hf_config.get("tie_word_embeddings", False)))


def read_teacher_head(path: str | os.PathLike) -> TeacherHeadShape:
    """The teacher's ``(vocab_size, hidden_size, tied)`` from the ``config.json`` of checkpoint ``path``.

    Raises:
        FileNotFoundError: there is no ``config.json`` at ``path``.
        ValueError: the config lacks the vocabulary or hidden size.
    """
    return TeacherHeadShape.from_config(read_config(path))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TeacherHeadPlan:
    """The teacher head shard and the hidden-signal loss buffers on one student rank of the last stage."""

    teacher: TeacherHeadShape
    student_vocab_size: int
    """Rows of the student's output layer (its padded table), which the shards split."""
    tensor_model_parallel_size: int
    params_dtype: str
    """The shard's dtype: the student's parameter dtype (planner names: ``bf16``, ``fp32`` ...)."""
    chunk_size: int
    """Tokens per chunk of the hidden-signal loss (``loss.chunk_size``)."""

    def __post_init__(self):
        tp = self.tensor_model_parallel_size
        if tp < 1 or self.student_vocab_size % tp:
            raise ValueError(f"the student's vocabulary of {self.student_vocab_size} rows does not split over "
                             f"tensor_model_parallel_size={tp}")
        if self.params_dtype not in DTYPE_BYTES or self.chunk_size < 1:
            raise ValueError(f"params_dtype={self.params_dtype!r} (one of {sorted(DTYPE_BYTES)}) and "
                             f"chunk_size={self.chunk_size} (>= 1) describe the teacher head's rank")

    @property
    def rows_per_rank(self) -> int:
        return self.student_vocab_size // self.tensor_model_parallel_size

    @property
    def shape(self) -> tuple[int, int]:
        """``[V_student / tp, h_teacher]``: the teacher head shard of one rank."""
        return self.rows_per_rank, self.teacher.hidden_size

    @property
    def shard_bytes(self) -> int:
        return self.rows_per_rank * self.teacher.hidden_size * DTYPE_BYTES[self.params_dtype]

    @property
    def loss_buffer_bytes(self) -> int:
        """The loss's chunk buffers (:data:`HIDDEN_LOSS_CHUNK_BUFFERS` x ``[chunk_size, V/tp]`` float32)."""
        return HIDDEN_LOSS_CHUNK_BUFFERS * self.chunk_size * self.rows_per_rank * HIDDEN_LOSS_BUFFER_BYTES

    @property
    def rows_without_teacher(self) -> int:
        """Rows of the student's table past the end of the teacher's (zeros in every shard)."""
        return max(0, self.student_vocab_size - self.teacher.vocab_size)

    def describe(self) -> str:
        """One line for plans and dry runs."""
        rows, hidden = self.shape
        text = (f"teacher table {self.teacher.vocab_size} x {self.teacher.hidden_size}"
                f"{' (tied embedding)' if self.teacher.tied else ''} -> [{rows}, {hidden}] {self.params_dtype} "
                f"per student TP rank (tp {self.tensor_model_parallel_size}) of the last stage = "
                f"{self.shard_bytes:,} bytes ({self.shard_bytes / 2**30:.2f} GiB), frozen; loss chunk buffers "
                f"~{HIDDEN_LOSS_CHUNK_BUFFERS} x [{self.chunk_size}, {rows}] fp32 = "
                f"{self.loss_buffer_bytes / 2**30:.2f} GiB")
        if self.rows_without_teacher:
            text += (f"; rows {self.teacher.vocab_size}-{self.student_vocab_size - 1} of the student's table have "
                     f"no teacher row (zeros): the tokenizer must have at most {self.teacher.vocab_size} entries")
        return text


def plan_teacher_head(
    student_vocab_size: int,
    teacher: TeacherHeadShape,
    *,
    tensor_model_parallel_size: int,
    params_dtype: str,
    chunk_size: int,
) -> TeacherHeadPlan:
    """The teacher head shard of a student with ``student_vocab_size`` rows split over ``tensor_model_parallel_size``.

    Raises:
        ValueError: the student's vocabulary does not split over the TP size, or a size is invalid.
    """
    return TeacherHeadPlan(teacher=teacher, student_vocab_size=student_vocab_size,
                           tensor_model_parallel_size=tensor_model_parallel_size, params_dtype=params_dtype,
                           chunk_size=chunk_size)


def plan_teacher_head_from_checkpoints(
    student_checkpoint: str | os.PathLike | None,
    head_checkpoint: str | os.PathLike | None,
    *,
    tensor_model_parallel_size: int,
    params_dtype: str,
    chunk_size: int,
) -> TeacherHeadPlan:
    """:func:`plan_teacher_head` from the student's and the teacher's ``config.json`` (what dry runs have).

    Raises:
        ValueError: a checkpoint is not given, its ``config.json`` cannot be read or lacks the sizes, or
            the student's vocabulary does not split over the TP size.
    """
    configs = []
    for what, path in (("student", student_checkpoint), ("teacher head", head_checkpoint)):
        if not path:
            raise ValueError(f"no {what} checkpoint in the config")
        try:
            configs.append(read_config(path))
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read the {what}'s config.json ({error})") from None
    student, teacher = configs
    if student.get("vocab_size") is None:
        raise ValueError(f"the student's config.json at {student_checkpoint} lacks vocab_size")
    return plan_teacher_head(int(student["vocab_size"]), TeacherHeadShape.from_config(teacher),
                             tensor_model_parallel_size=tensor_model_parallel_size, params_dtype=params_dtype,
                             chunk_size=chunk_size)
