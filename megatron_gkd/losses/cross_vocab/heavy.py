"""Teacher ids with a large fan-in projected densely, for the cross-tokenizer loss (:mod:`.loss`).

The loss's own cost is the map entries under each row's teacher ids: for each (row, id, student) a gather, an
``exp`` and a scatter (:class:`~.cross_vocab.ProjectedEntries`), in the forward and again in the backward. On a real
map a few teacher ids (common tokens, the first pieces of split words) are reached from hundreds of student tokens
and are named by most rows, and they hold most of those entries. For them this module takes one product per block
of rows instead, over the ``S`` students that the ``H`` heavy ids reach on this rank:

    totals[h, r] = sum_s W[s, t_h] exp(z[r, s] - m_r)               ([H, S] sparse x [S, rows] dense)
    y[r, h] = m_r + log totals[h, r]

with ``m_r`` the row's largest logit on this rank (every factor is at most 1). Its cost per row is the heavy
columns' entries, shared by all ``H`` ids instead of paid per (row, id), and it reads each of the ``S`` logits of a
row once. The backward is the transposed product, added to the ``S`` columns of the row's gradient:

    d loss / d z[r, s] += exp(z[r, s] - m_r) / T * sum_h W[s, t_h] g[r, h] exp(m_r - y[r, h])

Which ids (:meth:`HeavyColumns.select`, once per call of the loss): this shard's entries on the id (its fan-in) at
least :data:`DENSE_MIN_FAN_IN`, and named by at least :data:`DENSE_MIN_ROW_SHARE` of the rows. The dense product
pays for every row, the per-entry path only for the rows that name the id; on the host an entry of that path
(forward and backward) costs about 4 times a (row, student) of the product (145 and 34 ns, docs/performance.md), so
an id named by fewer than about a quarter of the rows is cheaper per entry.

Exactness: a (row, id) whose total is below the square root of the compute dtype's smallest normal (its students
hold almost none of this rank's mass, some factors may have underflowed, and ``exp(m_r - y)`` would be huge) is
projected per entry instead, where each slot's own maximum is taken out; the rest is the same sum in another order.

On the host the loss reads every entry with numba kernels instead (:mod:`.kernels`); this module serves
accelerators, narrow logits and the fused path.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from megatron_gkd.losses.cross_vocab.projection_map import ProjectionShard

# A teacher id is projected densely when this shard holds at least this many of its map entries ...
DENSE_MIN_FAN_IN = 8
# ... and at least this share of the rows names it (tests set both to 0 or to infinity).
DENSE_MIN_ROW_SHARE = 1 / 4
# What one heavy student costs in each row of a live block (its gathered logit turned factor, the product's contiguous
# copy of it, the backward's product and gradient value): blocks budget it beside the per-entry path's entries
# (cross_vocab._BYTES_PER_ENTRY). With 8 bytes the host measured 1-2 MiB over the same-tokenizer loss, over a chunk.
BYTES_PER_HEAVY_STUDENT = 16


def smallest_total(dtype: torch.dtype) -> float:
    """Below this a dense total is recomputed per entry: ``1 / it`` times any gradient stays finite."""
    return torch.finfo(dtype).tiny ** 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class HeavyColumns:
    """This shard's map columns of the heavy teacher ids of one batch, as two sparse CSR products.

    Attributes:
        students: ``[S]`` this shard's columns of the students that the heavy ids reach, ascending.
        forward_matrix: ``[H, S]`` ``W^T`` restricted to them (sparse CSR, compute dtype).
        backward_matrix: ``[S, H]`` ``W`` restricted to them (sparse CSR, compute dtype).
        slot_column: ``[N, K]`` the heavy index of each row's teacher id, ``-1`` where it is not heavy or not valid.
    """

    students: torch.Tensor
    forward_matrix: torch.Tensor
    backward_matrix: torch.Tensor
    slot_column: torch.Tensor

    @property
    def num_students(self) -> int:
        return int(self.students.numel())

    @property
    def is_heavy(self) -> torch.Tensor:
        return self.slot_column >= 0

    @classmethod
    def select(cls, ids: torch.Tensor, valid: torch.Tensor, shard: ProjectionShard,
               dtype: torch.dtype) -> "HeavyColumns | None":
        """The heavy ids of ``ids`` (``[N, K]``, ``valid`` marks real entries) on ``shard``; ``None`` when there are
        none. A few host syncs, once per call of the loss."""
        num_rows, width = ids.shape
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        named = torch.bincount(safe[valid], minlength=shard.teacher_vocab_size)  # rows naming each id
        fan_in = shard.indptr[1:] - shard.indptr[:-1]
        heavy = (fan_in >= max(1.0, DENSE_MIN_FAN_IN)) & (named >= max(1.0, DENSE_MIN_ROW_SHARE * num_rows))
        columns = torch.nonzero(heavy).squeeze(1)
        num_heavy = columns.numel()
        if num_heavy == 0:
            return None
        device = ids.device
        lengths = fan_in[columns]
        heavy_of_entry = torch.repeat_interleave(torch.arange(num_heavy, device=device), lengths)
        position = (torch.arange(heavy_of_entry.numel(), device=device)
                    + (shard.indptr[columns] - lengths.cumsum(0) + lengths)[heavy_of_entry])
        # Within a teacher id the shard's entries are sorted by student, so each CSR row's columns ascend.
        students, column = torch.unique(shard.student_index[position], return_inverse=True)
        weight = shard.weight[position].to(dtype)
        num_students = students.numel()
        order = torch.argsort(column * num_heavy + heavy_of_entry)
        with warnings.catch_warnings():  # CSR is "in beta"; the invariants hold by construction (checks cost time)
            warnings.filterwarnings("ignore", "Sparse (CSR tensor support|invariant checks)", UserWarning)
            forward_matrix = torch.sparse_csr_tensor(_row_pointers(lengths), column, weight, (num_heavy, num_students))
            backward_matrix = torch.sparse_csr_tensor(
                _row_pointers(torch.bincount(column, minlength=num_students)), heavy_of_entry[order], weight[order],
                (num_students, num_heavy))
        found = torch.searchsorted(columns, safe).clamp_(max=num_heavy - 1)
        hit = valid & (columns[found] == safe)
        slot_column = torch.where(hit, found, torch.full_like(found, -1)).view(num_rows, width)
        return cls(students, forward_matrix, backward_matrix, slot_column)

    def factors(self, logits: torch.Tensor, shift: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, S]`` ``exp(z - m)`` at the heavy students of ``logits`` (``[rows, V/tp]``), ``shift`` ``m``
        ``[rows]``."""
        z = logits.index_select(1, self.students).to(dtype)
        if temperature != 1.0:
            z.div_(temperature)
        return z.sub_(shift.unsqueeze(1)).exp_()

    @property
    def num_ids(self) -> int:
        return int(self.forward_matrix.shape[0])

    def totals(self, factors: torch.Tensor) -> torch.Tensor:
        """``[H, rows]`` ``sum_s W[s, t_h] f[r, s]`` of ``factors`` ``f`` (``[rows, S]``, the rows' ``exp(z - m)`` at
        the heavy students)."""
        return torch.sparse.mm(self.forward_matrix, factors.t())

    def pick(self, totals: torch.Tensor, shift: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``([rows, K] y, [rows, K] dense)`` from the rows' ``totals`` (``[H, rows]``, relative to ``exp(shift)``):
        this shard's projected logits at the heavy ids of ``rows``, and where they are taken from here (heavy, and a
        total that is not too small)."""
        slot_column = self.slot_column[rows]
        picked = totals.t().gather(1, slot_column.clamp(min=0))  # [rows, K]
        dense = (slot_column >= 0) & (picked >= smallest_total(totals.dtype))
        return shift.unsqueeze(1) + picked.log(), dense

    def gradient(self, logits: torch.Tensor, shift: torch.Tensor, rows: slice, dense: torch.Tensor,
                 projected: torch.Tensor, slot_grad: torch.Tensor, temperature: float,
                 dtype: torch.dtype) -> torch.Tensor:
        """``[rows, S]`` the dense slots' part of the logit gradient at the heavy students (``dense``, ``projected``
        (global ``y``) and ``slot_grad`` (``d loss / d y``) are the rows' ``[rows, K]``)."""
        num_heavy = self.num_ids
        scale = torch.where(dense, slot_grad * (shift.unsqueeze(1) - projected).exp(), torch.zeros_like(slot_grad))
        index = torch.where(dense, self.slot_column[rows], torch.full_like(self.slot_column[rows], num_heavy))
        per_id = torch.zeros(scale.shape[0], num_heavy + 1, dtype=dtype, device=scale.device)
        per_id.scatter_(1, index, scale)  # the last column collects the other slots' zeros
        summed = torch.sparse.mm(self.backward_matrix, per_id[:, :num_heavy].t().contiguous())  # [S, rows]
        values = self.factors(logits, shift, temperature, dtype).mul_(summed.t())
        if temperature != 1.0:
            values.div_(temperature)
        return values


def _row_pointers(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])
