"""The cross-tokenizer map ``W`` (student vocabulary -> teacher vocabulary) as the loss holds it: each TP rank's rows
for its student ids, like the output layer, as a CSR over teacher ids (:class:`ProjectionShard`), built from the map
builder's COO data contract (:func:`shard_projection`). The loss is :mod:`megatron_gkd.losses.cross_vocab.loss`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

PROJECTION_METHODS = ("projected", "hybrid")
# float32 weights of a row of up to a few entries sum to 1 within a few ulps; more is a map that is not one.
_ROW_SUM_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True, slots=True)
class ProjectionShard:
    """This rank's rows of ``W`` (student ids ``[vocab_start, vocab_start + vocab_size_local)``), by teacher id.

    Attributes:
        indptr: ``[V_t + 1]`` int64; the entries of teacher id ``t`` are ``[indptr[t], indptr[t+1])``.
        student_index: ``[nnz_local]`` int64 column of the student token in this shard.
        weight: ``[nnz_local]`` float32 ``W[s, t]`` (> 0).
        method: ``projected`` or ``hybrid`` (the entries already reflect it).
        mapped_rows_end: one past the largest student id with an entry on any rank (the loss refuses a map whose
            entries reach its padding rows).
    """

    student_vocab_size: int
    teacher_vocab_size: int
    vocab_start: int
    vocab_size_local: int
    indptr: torch.Tensor
    student_index: torch.Tensor
    weight: torch.Tensor
    method: str
    mapped_rows_end: int

    @property
    def num_entries(self) -> int:
        return int(self.student_index.numel())


def _check_map(student_ids: np.ndarray, teacher_ids: np.ndarray, weights: np.ndarray, student_vocab_size: int,
               teacher_vocab_size: int, exact: np.ndarray) -> None:
    if not (student_ids.ndim == teacher_ids.ndim == weights.ndim == 1) or not (
            student_ids.shape == teacher_ids.shape == weights.shape):
        raise ValueError(f"student_ids {student_ids.shape}, teacher_ids {teacher_ids.shape} and weights "
                         f"{weights.shape} must be 1-D arrays of one length (the map's COO entries)")
    if not (np.issubdtype(student_ids.dtype, np.integer) and np.issubdtype(teacher_ids.dtype, np.integer)):
        raise ValueError(f"student_ids and teacher_ids must be integer arrays, got {student_ids.dtype}, "
                         f"{teacher_ids.dtype}")
    if exact.shape != (student_vocab_size,) or exact.dtype != np.bool_:
        raise ValueError(f"exact must be a bool array of shape ({student_vocab_size},) (student_vocab_size), got "
                         f"{exact.dtype} {exact.shape}")
    if student_ids.size and (student_ids.min() < 0 or student_ids.max() >= student_vocab_size):
        raise ValueError(f"student_ids must lie in [0, {student_vocab_size}) (student_vocab_size; padding rows of "
                         f"the output layer map to nothing), got [{student_ids.min()}, {student_ids.max()}]")
    if teacher_ids.size and (teacher_ids.min() < 0 or teacher_ids.max() >= teacher_vocab_size):
        raise ValueError(f"teacher_ids must lie in [0, {teacher_vocab_size}) (teacher_vocab_size), got "
                         f"[{teacher_ids.min()}, {teacher_ids.max()}]")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("weights must be finite and >= 0")


def shard_projection(
    student_ids: np.ndarray,
    teacher_ids: np.ndarray,
    weights: np.ndarray,
    *,
    student_vocab_size: int,
    teacher_vocab_size: int,
    exact: np.ndarray,
    tp_rank: int,
    tp_size: int,
    vocab_size_local: int,
    method: str = "projected",
    device: torch.device | str = "cpu",
) -> ProjectionShard:
    """This TP rank's shard of the map builder's COO ``W`` (the data contract of megatron_gkd/xtok).

    Args:
        student_ids, teacher_ids, weights: ``[nnz]`` int64, int64, float32 COO entries of ``W``; a mapped
            student token's row sums to 1, unmapped and padding rows are empty; repeated ``(s, t)`` pairs add up.
        student_vocab_size, teacher_vocab_size: rows of ``W`` and its columns: the tokenizers' sizes, or the output
            layers' rows with their padding (megatron_gkd/xtok's ProjectionMap); padding rows must be empty.
        exact: ``[student_vocab_size]`` bool, student tokens with an exact single-token teacher match (their
            row is that one teacher id with weight 1).
        tp_rank, tp_size, vocab_size_local: the output layer's split (``V_s/tp`` rows on each rank).
        method: ``projected`` (P-KL) or ``hybrid`` (H-KL: see :mod:`megatron_gkd.losses.cross_vocab.loss`).

    Raises:
        ValueError: malformed entries, a mapped row that does not sum to 1, an ``exact`` row that is not one
            entry of weight 1, a vocabulary larger than the output layer, or an unknown method.
    """
    if method not in PROJECTION_METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(PROJECTION_METHODS)}")
    if not 0 <= tp_rank < tp_size or student_vocab_size > tp_size * vocab_size_local:
        raise ValueError(f"student_vocab_size={student_vocab_size} must fit the output layer's "
                         f"{tp_size} x {vocab_size_local} rows, and tp_rank={tp_rank} lie in [0, {tp_size})")
    student_ids, teacher_ids = np.asarray(student_ids), np.asarray(teacher_ids)
    weights, exact = np.asarray(weights, dtype=np.float32), np.asarray(exact)
    _check_map(student_ids, teacher_ids, weights, student_vocab_size, teacher_vocab_size, exact)
    # Coalesce repeated pairs (COO semantics), drop zero weights.
    key = student_ids.astype(np.int64) * teacher_vocab_size + teacher_ids.astype(np.int64)
    key, inverse = np.unique(key, return_inverse=True)
    summed = np.zeros(key.size, dtype=np.float64)
    np.add.at(summed, inverse, weights.astype(np.float64))
    keep = summed > 0
    key, summed = key[keep], summed[keep]
    rows, cols = key // teacher_vocab_size, key % teacher_vocab_size
    row_sums = np.bincount(rows, weights=summed, minlength=student_vocab_size)
    mapped = np.bincount(rows, minlength=student_vocab_size) > 0
    bad = np.flatnonzero(mapped & (np.abs(row_sums - 1.0) > _ROW_SUM_TOLERANCE))
    if bad.size:
        raise ValueError(f"the weights of student token {bad[0]} sum to {row_sums[bad[0]]:.6g}, not 1 "
                         f"({bad.size} rows like it): a mapped student token must spread exactly its own mass")
    counts = np.bincount(rows, minlength=student_vocab_size)
    exact_rows = np.flatnonzero(exact)
    wrong = exact_rows[(counts[exact_rows] != 1)]
    if wrong.size:
        raise ValueError(f"student token {wrong[0]} is marked exact but its row has {counts[wrong[0]]} entries "
                         "(an exact match is one teacher id with weight 1)")
    if method == "hybrid" and exact_rows.size:
        partners = np.zeros(teacher_vocab_size, dtype=bool)
        partners[cols[np.isin(rows, exact_rows)]] = True
        keep = ~partners[cols] | exact[rows]
        rows, cols, summed = rows[keep], cols[keep], summed[keep]
    start = tp_rank * vocab_size_local
    local = (rows >= start) & (rows < start + vocab_size_local)
    rows, cols, summed = rows[local], cols[local], summed[local]
    order = np.lexsort((rows, cols))  # by teacher id, then student id
    indptr = np.zeros(teacher_vocab_size + 1, dtype=np.int64)
    indptr[1:] = np.cumsum(np.bincount(cols, minlength=teacher_vocab_size))
    return ProjectionShard(
        student_vocab_size=student_vocab_size,
        teacher_vocab_size=teacher_vocab_size,
        vocab_start=start,
        vocab_size_local=vocab_size_local,
        indptr=torch.from_numpy(indptr).to(device),
        student_index=torch.from_numpy(rows[order] - start).to(device),
        weight=torch.from_numpy(summed[order].astype(np.float32)).to(device),
        method=method,
        mapped_rows_end=int(key.max() // teacher_vocab_size) + 1 if key.size else 0,
    )


def with_student_columns(shard: ProjectionShard, real_vocab_size: int) -> ProjectionShard:
    """``shard`` with the student's own vocabulary appended as columns: teacher id ``V_t + s`` is student token ``s``
    (``W[s, V_t + s] = 1`` for the real tokens ``s < real_vocab_size``; padding rows stay empty). A row whose ids all
    lie in that block is the same-tokenizer comparison at those student ids; a row whose ids all lie below ``V_t`` is
    the projection. A cross-tokenizer teacher's rows inside multi-token groups (the chain rule,
    :mod:`megatron_gkd.teacher.clients.cross_request`) are student-vocabulary rows; a row never mixes the two.
    """
    start = shard.vocab_start
    stop = max(start, min(start + shard.vocab_size_local, real_vocab_size))
    local = torch.arange(stop - start, dtype=shard.student_index.dtype, device=shard.student_index.device)
    # Column V_t + s holds this rank's student s; the columns of other ranks' students (and of padding) are empty.
    counts = torch.zeros(shard.student_vocab_size, dtype=torch.int64, device=shard.indptr.device)
    counts[start:stop] = 1
    return dataclasses.replace(
        shard,
        teacher_vocab_size=shard.teacher_vocab_size + shard.student_vocab_size,
        indptr=torch.cat([shard.indptr, shard.indptr[-1] + torch.cumsum(counts, 0)]),
        student_index=torch.cat([shard.student_index, local]),
        weight=torch.cat([shard.weight, torch.ones(len(local), dtype=shard.weight.dtype, device=shard.weight.device)]),
        mapped_rows_end=max(shard.mapped_rows_end, real_vocab_size),
    )
