"""The teacher's output layer on the student's tensor-parallel ranks (``teacher.signal=hidden``).

The teacher sends its final hidden states; each student rank recomputes the teacher's logits for its
own vocabulary shard, so it needs the rows of the teacher's output layer that its shard of the
student's table covers, split exactly like the student's own output layer (rank r of tp holds rows
``[r * V_s/tp, (r + 1) * V_s/tp)``). Only those rows are read from the safetensors files, through the
same sliced reader as :func:`megatron_gkd.models.load_hf`; the rest of the teacher is never touched.

Vocabulary alignment (the rules of the top-k path, docs/teacher_protocol.md): the student's padded
table and the teacher's may differ in length. Ids below ``real_vocab_size`` (the shared tokenizer)
must have a teacher row; rows at or past it are padding that the loss masks on both sides, and rows
past the end of the teacher's table do not exist: both are zeros in the shard, so that a read of
them shows up as a constant logit instead of another token's weights.
"""

from __future__ import annotations

import logging
import os

import torch

from megatron_gkd.models.checkpoints import resolve_checkpoint
from megatron_gkd.models.hf_config import read_hf_config
from megatron_gkd.models.loading import SafetensorsCheckpoint
from megatron_gkd.models.mapping import find_rule
from megatron_gkd.models.registry import get_architecture
from megatron_gkd.planning.teacher_head import TeacherHeadShape, read_teacher_head

logger = logging.getLogger(__name__)

OUTPUT_LAYER = "output_layer.weight"
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def teacher_head_shape(checkpoint: str | os.PathLike) -> TeacherHeadShape:
    """The teacher's ``(vocab_size, hidden_size, tied)`` from its ``config.json``; no weights are read.

    Raises:
        FileNotFoundError: there is no ``config.json``.
        ValueError: the config lacks the vocabulary or hidden size.
    """
    return read_teacher_head(checkpoint)


def output_layer_name(hf_config: dict) -> str:
    """The HF tensor that is the output layer: ``lm_head.weight``, or the embedding when tied.

    Taken from the architecture's weight mapping, the rule :func:`megatron_gkd.models.load_hf` fills the
    student's own output layer with.

    Raises:
        ValueError: the architecture is not supported.
    """
    found = find_rule(get_architecture(hf_config).weight_rules(hf_config), OUTPUT_LAYER)
    assert found is not None and len(found[0].hf) == 1, f"the mapping of {OUTPUT_LAYER} is not one HF tensor"
    return found[0].hf_names(found[1])[0]


def _check_layout(student_vocab_size: int, tp_rank: int, tp_size: int, real_vocab_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is not a rank of a tensor-parallel group of size {tp_size}")
    if student_vocab_size % tp_size:
        raise ValueError(f"the student's vocabulary of {student_vocab_size} rows does not split over "
                         f"tensor_model_parallel_size={tp_size}")
    if not 0 < real_vocab_size <= student_vocab_size:
        raise ValueError(f"real_vocab_size={real_vocab_size} (the tokenizer's entries) must be in "
                         f"[1, {student_vocab_size}], the student's table")


def load_teacher_head(
    checkpoint: str | os.PathLike,
    *,
    student_vocab_size: int,
    tp_rank: int,
    tp_size: int,
    real_vocab_size: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """This rank's frozen shard of the teacher's output layer, ``[student_vocab_size / tp_size, h_teacher]``.

    Row i of the shard is row ``tp_rank * student_vocab_size / tp_size + i`` of the teacher's table, or
    zeros where that id is at or past ``real_vocab_size`` (padding) or past the teacher's table.

    Args:
        checkpoint: the teacher's HF checkpoint directory (``config.json`` and ``*.safetensors``,
            sharded with an index or not), or a GGUF file; only the output layer's rows of this shard are read.
        student_vocab_size: rows of the student's (padded) output layer, which the ranks split.
        tp_rank, tp_size: this rank in the student's tensor-parallel group, and the group's size.
        real_vocab_size: the tokenizer's entries; ids at or past it are padding.
        dtype: the shard's dtype (the student's parameter dtype).
        device: where the shard lives (default: torch's default device).

    Returns:
        A ``[student_vocab_size / tp_size, h_teacher]`` tensor that does not require a gradient.

    Raises:
        ValueError: the layout is inconsistent, the teacher's table has fewer rows than
            ``real_vocab_size``, the config disagrees with the weights, or the table is stored in float8.
        KeyError: the checkpoint lacks the output layer's tensor.
    """
    _check_layout(student_vocab_size, tp_rank, tp_size, real_vocab_size)
    # A GGUF's float32 conversion holds its values exactly; a caller that serves it in another dtype passes that
    # conversion's directory instead (resolve_checkpoint), so that one conversion serves both.
    checkpoint = resolve_checkpoint(checkpoint, dtype="float32")
    hf_config = read_hf_config(checkpoint)
    name = output_layer_name(hf_config)
    rows = student_vocab_size // tp_size
    start = tp_rank * rows
    with SafetensorsCheckpoint(checkpoint) as source:
        shape = source.shape(name)
        if len(shape) != 2:
            raise ValueError(f"{name} of {checkpoint} has shape {tuple(shape)}; an output layer is [vocab, hidden]")
        teacher_rows, hidden = shape
        declared = TeacherHeadShape.from_config(hf_config)
        if (declared.vocab_size, declared.hidden_size) != (teacher_rows, hidden):
            raise ValueError(f"{checkpoint}: config.json declares a {declared.vocab_size} x {declared.hidden_size} "
                             f"output layer but {name} is {teacher_rows} x {hidden}")
        if teacher_rows < real_vocab_size:
            raise ValueError(f"the teacher's output layer has {teacher_rows} rows, fewer than the {real_vocab_size} "
                             "entries of the tokenizer (real_vocab_size): ids past its table have no teacher logit; "
                             "student and teacher must share the tokenizer")
        shard = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # real_vocab_size <= teacher_rows, so this stop also stays inside the teacher's table.
        stop = min(start + rows, real_vocab_size)
        if stop > start:
            piece = source.read(name, (slice(start, stop), slice(None)))
            if piece.dtype in _FLOAT8:
                raise ValueError(f"{name} of {checkpoint} is stored in {piece.dtype}, which needs its block scales; "
                                 "give teacher.head_checkpoint a checkpoint with a bf16/fp16/fp32 output layer")
            shard[: stop - start].copy_(piece)
    logger.info("teacher head: rows [%d, %d) of %s (%d x %d) from %s, %d read, as [%d, %d] %s", start, start + rows,
                name, teacher_rows, hidden, checkpoint, max(0, stop - start), rows, hidden, dtype)
    return shard
