"""Cross-tokenizer distillation on the vocab-parallel loss: the student's distribution projected into the
teacher's vocabulary through a sparse map ``W``, on the student's ``[N, V_s/tp]`` logit shard (never gathered).

Definitions (X-Token, arXiv 2605.21699; NeMo-RL #2508 / #2797 for the map and its use). With ``z = logits / T``
over the student's real vocabulary, ``p = softmax(z)`` and ``L = logsumexp(z)``, the projected student is

    q(t) = sum_s p(s) W[s, t],   log q(t) = y_t - L,   y_t = log sum_s W[s, t] exp(z_s)   ("projected logit").

* ``projected`` (X-Token's P-KL): ``W`` as built (each mapped student token spreads its mass over the teacher
  tokens of its re-tokenisation; exact string matches are one-hot rows).
* ``hybrid`` (X-Token's H-KL, GOLD's hybrid on a top-k signal): a teacher token that is the exact match of a
  student token is compared with that student token alone (``q(t) = p(s*)``, the same-tokenizer comparison);
  the other student tokens' pieces that also land on it are dropped. Other teacher tokens keep the projection.
  GOLD's and X-Token's sorted-L1 term on the unmatched tail needs both full distributions: not on a top-k signal.

The divergence is then exactly the same-tokenizer one (:mod:`.divergences`) with ``y`` in place of the student's
logits at the teacher's ids and the same ``L``: ``forward_kl`` keeps the teacher unrenormalised and ``q`` normalised
over the whole student vocabulary (mass on unmapped student tokens, and on teacher tokens outside the top-k, is the
remainder); ``reverse_kl`` and ``jsd`` renormalise both on the compared support; ``kl_rkl`` mixes them. With
``W = identity`` every value and gradient equals :func:`.vocab_parallel_distill_loss`'s. A teacher id that no
student token reaches (``q(t) = 0`` for every student) cannot be compared (the forward KL would be infinite): it
leaves the compared support like a padding entry, and its teacher mass is reported as ``unmapped_teacher_mass``.
``tcad`` is not offered: its support is the student's own top-k (student ids) scored by the teacher, which needs
requested-id scoring through the inverse map.

Layout: rank r of TP holds the map's rows for student ids ``[r V/tp, (r+1) V/tp)``, like the output layer, as a
CSR over teacher ids (:class:`~.projection_map.ProjectionShard`, built by
:func:`~.projection_map.shard_projection`). A rank projects its shard at the teacher ids of each row
(``y_t`` over its own students, a stable log-sum-exp per (row, id)), and ONE all-gather of ``[N, 1+K]`` combines
the log-partitions and the partial ``y`` by ``logsumexp`` over ranks. The backward writes the gradient in one pass:
``lse_coef softmax(z)`` densely plus, for each map entry under a compared id, ``g_t W[s,t] exp(z_s - y_t)``.
The forward reads each row chunk's ``exp(z - m)`` at the map entries while the log-partition pass has it in cache
(:func:`local_pass`). On the host (CPU fp32/fp64 logits, numba installed) the entries are read by compiled loops over
the map's CSR (:mod:`.kernels`), which materialise nothing per entry. Elsewhere torch operations build
them block by block, and teacher ids with a large fan-in that many rows name are projected instead by one sparse
product per block of rows over the students they reach (:mod:`.heavy`; :class:`LocalPlan` records which
slots took it); besides the same-tokenizer loss that path holds the map entries under the support (the ids' fan-in)
and the dense product's ``[rows, S]`` factors, one block of rows at a time, at most one ``[c, V/tp]`` chunk's bytes.

The fused output layer (``hidden @ W^T`` recomputed in token chunks) is :mod:`.fused`. The teacher's
``hidden`` signal is compared as its exact top-k (:func:`megatron_gkd.losses.hidden.hidden_topk`, made in the step from
its hidden states and its head's rows of its own vocabulary); the comparison over the whole teacher vocabulary is
:mod:`.hidden`. docs/performance.md "Cross-tokenizer loss" holds the figures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_gkd.losses import divergences as _divergences  # noqa: F401 - registers the losses
from megatron_gkd.losses.cross_vocab import kernels as cross_vocab_kernels
from megatron_gkd.losses.cross_vocab.heavy import BYTES_PER_HEAVY_STUDENT, HeavyColumns, smallest_total
from megatron_gkd.losses.cross_vocab.projection_map import ProjectionShard, shard_projection
from megatron_gkd.losses.registry import SupportInputs, cross_tokenizer_divergences, get_divergence
from megatron_gkd.losses.shard_ops import (
    ShardLayout,
    all_gather_rows,
    compute_dtype,
    exp_rows,
    logits_grad,
    rows_per_chunk,
)
from megatron_gkd.losses.vocab_parallel import TeacherSupport, check_temperature, prepare_teacher, split_options

__all__ = [  # shard_projection and ProjectionShard live in projection_map; the map builder finds them here too
    "ProjectionShard",
    "cross_vocab_distill_loss",
    "shard_projection",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ProjectedEntries:
    """The map entries of this shard under each row's teacher ids, in (row, id) order, for a block of rows.

    Entry ``e`` adds ``weight[e] exp(z.flatten()[flat[e]])`` to slot ``slot[e] = row * K + k`` of the block.
    """

    slot: torch.Tensor
    flat: torch.Tensor
    weight: torch.Tensor
    slot_counts: torch.Tensor  # [rows * K] entries per slot
    width: int  # K

    @property
    def row_offsets(self) -> list[int]:
        """Entries of the block's rows ``[a, b)`` are ``[offsets[a], offsets[b])``. One host sync."""
        return [0] + self.slot_counts.view(-1, self.width).sum(1).cumsum(0).tolist()

    @classmethod
    def of(cls, ids: torch.Tensor, valid: torch.Tensor, shard: ProjectionShard, dtype: torch.dtype) -> "ProjectedEntries":
        num_rows, width = ids.shape
        flat_ids = torch.where(valid, ids, torch.zeros_like(ids)).reshape(-1)
        starts = shard.indptr[flat_ids]
        counts = torch.where(valid.reshape(-1), shard.indptr[flat_ids + 1] - starts, torch.zeros_like(starts))
        slots = torch.arange(counts.numel(), device=ids.device)
        slot = torch.repeat_interleave(slots, counts)  # one host sync
        position = torch.arange(slot.numel(), device=ids.device) + (starts - counts.cumsum(0) + counts)[slot]
        row_start = torch.div(slots, width, rounding_mode="floor") * shard.vocab_size_local  # [rows * K], small
        return cls(slot, row_start[slot] + shard.student_index[position], shard.weight[position].to(dtype), counts,
                   width)

    def logits(self, logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
        """``[E]`` tempered student logits of the entries (``logits``: the block's rows), in ``dtype``."""
        z = torch.take(logits, self.flat).to(dtype)
        return z if temperature == 1.0 else z / temperature


def projected_logits(
    logits: torch.Tensor, entries: ProjectedEntries, num_slots: int, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """``[num_slots]`` ``log sum_e W exp(z)`` over this shard's entries of each slot (``-inf`` for none), with the
    slot's own maximum taken out first so that no term under- or overflows."""
    z = entries.logits(logits, temperature, dtype)
    peak = torch.full((num_slots,), float("-inf"), dtype=dtype, device=logits.device)
    peak.scatter_reduce_(0, entries.slot, z, reduce="amax")
    total = torch.zeros(num_slots, dtype=dtype, device=logits.device)
    total.index_add_(0, entries.slot, (z - peak[entries.slot]).exp_().mul_(entries.weight))
    return peak + total.log()


# What one map entry costs while a block is live (its slot, row, column and gather position in int64, its weight,
# logit, share and gradient value): blocks hold at most one [c, V/tp] fp32 chunk's bytes of entries (and of the heavy
# ids' dense product, cross_vocab_heavy.BYTES_PER_HEAVY_STUDENT per heavy student a row).
_BYTES_PER_ENTRY = 64


@dataclasses.dataclass(frozen=True, slots=True)
class LocalPlan:
    """How this rank goes through one batch's map entries: fixed by the forward, followed again by the backward.

    Attributes:
        blocks: row ranges ``[a, b)`` whose scratch fits one ``[c, V/tp]`` chunk (:func:`entry_blocks`).
        heavy: the teacher ids projected densely (:mod:`.heavy`), or ``None``.
        dense: ``[N, K]`` bool, the slots the forward took from the dense product (filled by it); ``None`` without
            heavy ids.
        local_lse: ``[N]`` this rank's log-partition of each row (filled by the forward).
        row_max: ``[N]`` each row's largest ``z`` on this rank (filled by the forward): the shift of its sums, and of
            the dense slots' gradient.
        kernel: the map read by the host kernels (:mod:`.kernels`, NumPy views of the shard's CSR), or
            ``None`` for torch operations. With them no entry is materialised (one block) and every slot is read per
            entry: no heavy ids (on the host their dense product saved nothing over the kernels' per-entry reads).
    """

    blocks: list[tuple[int, int]]
    heavy: HeavyColumns | None
    dense: torch.Tensor | None
    local_lse: torch.Tensor
    row_max: torch.Tensor
    kernel: cross_vocab_kernels.Csr | None

    @classmethod
    def of(cls, teacher: TeacherSupport, shard: ProjectionShard, dtype: torch.dtype,
           kernel: bool = False) -> "LocalPlan":
        """``kernel``: the host kernels serve this batch (:func:`.kernels.available`)."""
        num_rows, device = teacher.ids.shape[0], teacher.ids.device
        local_lse = torch.empty(num_rows, dtype=dtype, device=device)
        row_max = torch.empty(num_rows, dtype=dtype, device=device)
        if kernel:
            csr = cross_vocab_kernels.Csr.of(shard.indptr, shard.student_index, shard.weight)
            return cls([(0, num_rows)], None, None, local_lse, row_max, csr)
        heavy = HeavyColumns.select(teacher.ids, teacher.valid, shard, dtype)
        dense = None if heavy is None else torch.zeros_like(teacher.valid)
        blocks = entry_blocks(teacher.ids, teacher.valid, shard, heavy)
        return cls(blocks, heavy, dense, local_lse, row_max, None)

    def per_entry(self, mask: torch.Tensor, rows: slice) -> torch.Tensor:
        """``mask`` (the rows' ``[rows, K]``) without the slots of the dense product."""
        return mask if self.dense is None else mask & ~self.dense[rows]


def entry_blocks(ids: torch.Tensor, valid: torch.Tensor, shard: ProjectionShard,
                 heavy: HeavyColumns | None = None) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` whose map entries (those of the heavy ids excepted, their dense product counted instead)
    fit the scratch budget of one ``[c, V/tp]`` chunk (a row with more than that is a block of its own). One host
    sync."""
    per_entry = valid if heavy is None else valid & ~heavy.is_heavy
    flat_ids = torch.where(per_entry, ids, torch.zeros_like(ids))
    counts = torch.where(per_entry, shard.indptr[flat_ids + 1] - shard.indptr[flat_ids], torch.zeros_like(flat_ids))
    row_bytes = counts.sum(1) * _BYTES_PER_ENTRY
    if heavy is not None:
        row_bytes += heavy.num_students * BYTES_PER_HEAVY_STUDENT
    cumulative = row_bytes.cumsum(0).cpu()
    chunk = rows_per_chunk(shard.vocab_size_local, ids.device)
    budget = max(1, chunk * shard.vocab_size_local * 4)
    blocks, start, num_rows = [], 0, ids.shape[0]
    while start < num_rows:
        before = int(cumulative[start - 1]) if start else 0
        stop = int(torch.searchsorted(cumulative, before + budget, right=True))
        stop = min(num_rows, max(stop, start + 1))
        if stop - start > chunk:  # whole row chunks: the forward's pass goes through a block a chunk at a time
            stop = start + (stop - start) // chunk * chunk
        blocks.append((start, stop))
        start = stop
    return blocks


class _TorchBlock:
    """A block's map entries read with torch operations: :class:`ProjectedEntries` built once, each chunk's entries
    and heavy students gathered from its ``exp(z - m)``, then one ``index_add`` and one dense product."""

    def __init__(self, teacher: TeacherSupport, shard: ProjectionShard, plan: "LocalPlan", rows: slice, dtype):
        self.teacher, self.shard, self.plan, self.rows, self.dtype = teacher, shard, plan, rows, dtype
        heavy, device = plan.heavy, teacher.ids.device
        num_rows = rows.stop - rows.start
        self.heavy_slots = None if heavy is None else heavy.slot_column[rows] >= 0
        per_entry = teacher.valid[rows] if heavy is None else teacher.valid[rows] & ~self.heavy_slots
        self.entries = ProjectedEntries.of(teacher.ids[rows], per_entry, shard, dtype)
        self.offsets = self.entries.row_offsets
        self.shares = torch.empty(self.offsets[-1], dtype=dtype, device=device)  # each entry's exp(z - m)
        self.factors = None if heavy is None else torch.empty(num_rows, heavy.num_students, dtype=dtype, device=device)

    def read(self, first: int, last: int, exps: torch.Tensor) -> None:
        """Reads the block's rows ``[first, last)`` from their ``exps`` (``[last - first, V/tp]``)."""
        begin, end = self.offsets[first], self.offsets[last]
        if begin < end:
            torch.take(exps, self.entries.flat[begin:end] - first * exps.shape[1], out=self.shares[begin:end])
        if self.factors is not None:
            torch.index_select(exps, 1, self.plan.heavy.students, out=self.factors[first:last])

    def values(self, shift: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """``[rows, K]`` projected logits, given the rows' ``shift`` ``m`` and ``logits`` (for the exact fallback)."""
        entries, width, rows = self.entries, self.teacher.ids.shape[1], self.rows
        totals = torch.zeros(shift.numel() * width, dtype=self.dtype, device=shift.device)
        totals = totals.index_add_(0, entries.slot, self.shares.mul_(entries.weight)).view(-1, width)
        value = shift.unsqueeze(1) + totals.log()  # -inf where this shard has no entry
        exact = (entries.slot_counts.view(-1, width) > 0) & (totals < smallest_total(self.dtype))
        heavy = self.plan.heavy
        if heavy is not None:
            dense_value, dense = heavy.pick(heavy.totals(self.factors), shift, rows)
            self.plan.dense[rows] = dense
            value = torch.where(dense, dense_value, value)
            exact |= self.heavy_slots & ~dense
        if bool(exact.any()):
            again = ProjectedEntries.of(self.teacher.ids[rows], exact, self.shard, self.dtype)
            recomputed = projected_logits(logits, again, exact.numel(), temperature, self.dtype).view(-1, width)
            value = torch.where(exact, recomputed, value)
        return value


class _KernelBlock:
    """A block's map entries read by the host kernels (:mod:`.kernels`), every slot per entry: no entry is
    materialised."""

    def __init__(self, teacher: TeacherSupport, shard: ProjectionShard, plan: "LocalPlan", rows: slice, dtype):
        self.shard, self.plan, self.dtype = shard, plan, dtype
        self.valid = teacher.valid[rows]
        self.ids = torch.where(self.valid, teacher.ids[rows], torch.zeros_like(teacher.ids[rows]))  # 0 at padding
        self.totals = torch.empty(self.ids.shape, dtype=dtype, device=self.ids.device)
        self.arrays = self.ids.numpy(), self.valid.numpy(), self.totals.numpy()

    def read(self, first: int, last: int, exps: torch.Tensor) -> None:
        ids, valid, totals = self.arrays
        cross_vocab_kernels.project(exps, ids[first:last], valid[first:last], self.plan.kernel, totals[first:last])

    def values(self, shift: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        shard = self.shard
        value = shift.unsqueeze(1) + self.totals.log()  # -inf where this shard has no entry
        has_entries = self.valid & (shard.indptr[self.ids + 1] > shard.indptr[self.ids])
        exact = has_entries & (self.totals < smallest_total(self.dtype))
        if bool(exact.any()):
            ids, _, _ = self.arrays
            cross_vocab_kernels.project_exact(logits, ids, exact.numpy(), self.plan.kernel, temperature, value.numpy())
        return value


def local_pass(logits: torch.Tensor, teacher: TeacherSupport, shard: ProjectionShard, plan: LocalPlan,
               blocks: list[tuple[int, int]], temperature: float, dtype: torch.dtype, tokens_local: int,
               out: torch.Tensor | None = None, row_offset: int = 0) -> torch.Tensor:
    """``[N, K]`` this shard's ``log sum_s W[s, t] exp(z_s)`` at the teacher ids (``-inf`` where it has none), filling
    ``plan.local_lse`` (and ``plan.dense``) of the blocks' rows in the same pass over the logits.

    Each row chunk's ``exp(z - m)`` (``m`` the row's largest ``z``; :func:`exp_rows`, in one cache-sized scratch chunk)
    gives the chunk's log-partition, and is read there, while it is in cache, at the map entries of the block
    (:class:`_KernelBlock`, or :class:`_TorchBlock`: the entries built once a block, and the heavy ids' students):
    ``y = m + log sum W exp(z - m)``. A slot whose sum falls under :func:`~.cross_vocab_heavy.smallest_total` (its
    students hold almost none of the row's mass here, and some terms may have underflowed) is recomputed from the
    logits with its own maximum taken out; so are the heavy slots, which then stay per entry in the backward.
    ``logits`` may hold only rows ``[row_offset, ...)`` (the fused path's token chunk) when ``blocks`` lie inside
    them."""
    out = torch.empty(teacher.ids.shape, dtype=dtype, device=logits.device) if out is None else out
    if not blocks:
        return out
    if tokens_local == 0:  # every column of this shard is padding: no mass, no map entries
        for start, stop in blocks:
            plan.local_lse[start:stop] = float("-inf")
            out[start:stop] = float("-inf")
        return out
    vocab_local = logits.shape[1]
    chunk = rows_per_chunk(vocab_local, logits.device)
    work = torch.empty(min(chunk, max(stop - start for start, stop in blocks)), vocab_local, dtype=dtype,
                       device=logits.device)
    reader = _TorchBlock if plan.kernel is None else _KernelBlock
    for start, stop in blocks:
        rows, num_rows = slice(start, stop), stop - start
        block = reader(teacher, shard, plan, rows, dtype)
        block_logits = logits[start - row_offset:stop - row_offset]
        shift = torch.empty(num_rows, dtype=dtype, device=logits.device)
        for first in range(0, num_rows, chunk):
            last = min(first + chunk, num_rows)
            exps = work[: last - first]
            shift[first:last] = exp_rows(block_logits[first:last, :tokens_local], temperature,
                                         exps[:, :tokens_local])
            plan.local_lse[start + first:start + last] = shift[first:last] + exps[:, :tokens_local].sum(1).log()
            block.read(first, last, exps)
        plan.row_max[rows] = shift
        out[rows] = block.values(shift, block_logits, temperature)
    return out


class ProjectionGrad:
    """The support part of the gradient, ``g_t W[s, t] exp(z_s - y_t) / T`` on each map entry under a compared id,
    rebuilt block by block as :func:`logits_grad` asks for rows in order (it duck-types :class:`SparseGrad`); the
    dense slots' part is the heavy ids' transposed product. :meth:`attach` gives it the logits it reads."""

    def __init__(self, state: "ProjectedState", slot_grad: torch.Tensor, shard: ProjectionShard, temperature: float,
                 dtype: torch.dtype):
        self.state, self.slot_grad, self.shard = state, slot_grad, shard
        self.projected = state.projected.contiguous()  # a column slice of the combined values
        self.blocks, self.plan = state.plan.blocks, state.plan
        self.temperature, self.dtype = temperature, dtype
        self.logits, self.row_offset = None, 0
        self._block: tuple | None = None
        self._index = 0  # rows are asked for in order: the search for a row's block starts at the last one
        if self.plan.kernel is not None:
            self._kernel_arrays = self._for_kernels()
            self.slot_grad = None  # its storage now holds the kernels' coefficients

    def _for_kernels(self) -> tuple:
        """NumPy arrays of the host kernels' backward: the teacher ids, ``d loss / d y / T`` (0 off the compared slots,
        which the kernel skips: their ids are never read) and ``y``. The slots' gradient becomes the second in place:
        at the backward's peak the loss holds no ``[N, K]`` array more than the torch path (docs/performance.md)."""
        coef = self.slot_grad.masked_fill_(~self.state.compared, 0).div_(self.temperature)
        return self.state.teacher_ids.contiguous().numpy(), coef.numpy(), self.projected.numpy()

    def attach(self, logits: torch.Tensor, row_offset: int = 0) -> None:
        """Reads rows ``[row_offset, row_offset + len(logits))`` from ``logits`` from now on (the fused path attaches
        each token chunk's)."""
        self.logits, self.row_offset, self._block = logits, row_offset, None

    def ensure(self, row: int) -> None:
        """Builds the block that holds ``row`` unless it is the one held (the fused backward calls it before it
        overwrites the block's logits with their gradient)."""
        if self._block is None or not self._block[0] <= row < self._block[1]:
            if row < self.blocks[self._index][0]:
                self._index = 0
            while not self.blocks[self._index][0] <= row < self.blocks[self._index][1]:
                self._index += 1
            self._build(self._index)

    def _build(self, index: int) -> None:
        start, stop = self.blocks[index]
        rows, state, width = slice(start, stop), self.state, self.state.teacher_ids.shape[1]
        logits = self.logits[start - self.row_offset:stop - self.row_offset]
        entries = ProjectedEntries.of(state.teacher_ids[rows], self.plan.per_entry(state.compared[rows], rows),
                                      self.shard, self.dtype)
        z = entries.logits(logits, self.temperature, self.dtype)
        slot = entries.slot + start * width
        # d y_t / d z_s = W[s, t] exp(z_s - y_t): each entry's share of its slot's projected mass.
        values = (z - self.projected.view(-1)[slot]).exp_().mul_(entries.weight).mul_(self.slot_grad.view(-1)[slot])
        if self.temperature != 1.0:
            values.div_(self.temperature)
        offsets = entries.row_offsets
        heavy = None
        if self.plan.heavy is not None:
            heavy = self.plan.heavy.gradient(logits, self.plan.row_max[rows], rows, self.plan.dense[rows],
                                             self.projected[rows], self.slot_grad[rows], self.temperature, self.dtype)
        self._block = (start, stop, entries.flat, values, offsets, heavy)

    def _kernel_rows(self, out: torch.Tensor, start: int, stop: int) -> None:
        ids, coef, projected = (array[start:stop] for array in self._kernel_arrays)
        cross_vocab_kernels.grad_rows(self.logits[start - self.row_offset:stop - self.row_offset], ids, coef,
                                      projected, self.plan.kernel, self.temperature, out)

    def add_to_rows(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Adds the entries of rows ``[start, stop)`` into ``out`` (those rows, contiguous)."""
        if self.plan.kernel is not None:
            self._kernel_rows(out, start, stop)
            return
        row = start
        while row < stop:
            self.ensure(row)
            begin, end, flat_index, values, offsets, heavy = self._block
            last = min(stop, end)
            first_entry, last_entry = offsets[row - begin], offsets[last - begin]
            if first_entry < last_entry:
                flat = flat_index[first_entry:last_entry] - (start - begin) * out.shape[1]
                out.view(-1).index_add_(0, flat, values[first_entry:last_entry].to(out.dtype))
            if heavy is not None:
                out[row - start:last - start].index_add_(1, self.plan.heavy.students,
                                                         heavy[row - begin:last - begin].to(out.dtype))
            row = last


def combine_projection(
    local_lse: torch.Tensor, local_projected: torch.Tensor, layout: ShardLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``L`` ``[N]`` and projected logits ``y`` ``[N, K]`` from every rank's partial values, in one
    collective: both are log-sums of ``exp`` over the student vocabulary, split by rows, so they combine by
    ``logsumexp`` over ranks (a rank without entries holds ``-inf``, which adds exactly nothing)."""
    stacked = all_gather_rows(torch.cat([local_lse.unsqueeze(-1), local_projected], dim=-1), layout)
    combined = torch.logsumexp(stacked, dim=0)
    return combined[:, 0], combined[:, 1:]


@dataclasses.dataclass(frozen=True, slots=True)
class ProjectedState:
    """What the backward of either path needs besides the logits (or the tensors that make them)."""

    teacher_ids: torch.Tensor
    compared: torch.Tensor  # [N, K] valid teacher entries some student token reaches
    projected: torch.Tensor  # [N, K] global y
    student_lse: torch.Tensor
    grad_support: torch.Tensor
    lse_coef: torch.Tensor
    plan: LocalPlan


def evaluate_projection(
    student_lse: torch.Tensor, projected: torch.Tensor, teacher: TeacherSupport, plan: LocalPlan,
    divergence_name: str, options: Any,
) -> tuple[ProjectedState, torch.Tensor, dict[str, torch.Tensor]]:
    """The divergence of the combined ``L`` and ``y``, shared by the unfused and fused paths.

    Returns:
        ``(state for the backward, per-token loss, metrics)``.
    """
    compared = teacher.valid & torch.isfinite(projected)
    inputs = SupportInputs(
        torch.where(compared, projected, torch.zeros_like(projected)),
        torch.where(compared, teacher.logprobs, torch.full_like(teacher.logprobs, float("-inf"))),
        compared,
        student_lse,
    )
    terms = get_divergence(divergence_name).fn(inputs, options)
    teacher_probs = teacher.logprobs.exp()  # 0 at padding entries
    zero = torch.zeros_like(teacher_probs)
    on_support = inputs.student_logits.masked_fill(~compared, float("-inf")).logsumexp(-1)
    metrics = {
        "student_mass": (on_support - student_lse).exp(),
        "teacher_mass": torch.where(compared, teacher_probs, zero).sum(-1),
        "unmapped_teacher_mass": torch.where(teacher.valid & ~compared, teacher_probs, zero).sum(-1),
    }
    state = ProjectedState(teacher.ids, compared, projected, student_lse, terms.grad_support, terms.lse_coef, plan)
    return state, terms.loss, metrics


def projection_grad(state: ProjectedState, grad_loss: torch.Tensor, projection: ProjectionShard, temperature: float,
                    dtype: torch.dtype) -> tuple[torch.Tensor, ProjectionGrad]:
    """The backward's dense per-row scale ``[N]`` and the support part (to :meth:`~ProjectionGrad.attach` logits to),
    as :func:`~megatron_gkd.losses.vocab_parallel.backward_scales` gives them for the same-tokenizer loss."""
    grad_loss = grad_loss.to(dtype)
    dense_scale = state.lse_coef * grad_loss / temperature
    slot_grad = state.grad_support * grad_loss.unsqueeze(1)  # d loss / d y_t, 0 off the support
    return dense_scale, ProjectionGrad(state, slot_grad, projection, temperature, dtype)


class _CrossVocabDistill(torch.autograd.Function):
    """Per-token divergence between the teacher's top-k and the projected student; exact analytic backward."""

    @staticmethod
    def forward(ctx, logits, teacher, projection, layout, divergence_name, options, temperature):
        dtype = compute_dtype(logits.dtype)
        plan = LocalPlan.of(teacher, projection, dtype, kernel=cross_vocab_kernels.available(logits.device,
                                                                                              logits.dtype))
        local_projected = local_pass(logits, teacher, projection, plan, plan.blocks, temperature, dtype,
                                     layout.tokens_local)
        student_lse, projected = combine_projection(plan.local_lse, local_projected, layout)
        state, loss, metrics = evaluate_projection(student_lse, projected, teacher, plan, divergence_name, options)
        ctx.save_for_backward(logits)
        ctx.state, ctx.projection, ctx.temperature, ctx.dtype = state, projection, temperature, dtype
        ctx.tokens_local = layout.tokens_local
        ctx.mark_non_differentiable(*metrics.values())
        return loss, metrics["student_mass"], metrics["teacher_mass"], metrics["unmapped_teacher_mass"]

    @staticmethod
    def backward(ctx, grad_loss, grad_student_mass, grad_teacher_mass, grad_unmapped):
        del grad_student_mass, grad_teacher_mass, grad_unmapped
        (logits,) = ctx.saved_tensors
        dense_scale, sparse = projection_grad(ctx.state, grad_loss, ctx.projection, ctx.temperature, ctx.dtype)
        sparse.attach(logits)
        grad = logits_grad(logits, ctx.state.student_lse, dense_scale, sparse, ctx.temperature, ctx.dtype,
                           ctx.tokens_local)
        return grad, None, None, None, None, None, None


def check_projection(projection: ProjectionShard, layout: ShardLayout) -> None:
    """Refuses a map shard that is not this rank's rows of this output layer.

    Raises:
        ValueError: another rank's rows, another split, or student ids past the real vocabulary.
    """
    if (projection.vocab_size_local, projection.vocab_start) != (layout.vocab_size_local, layout.vocab_start):
        raise ValueError(
            f"the projection shard holds student rows [{projection.vocab_start}, {projection.vocab_start + projection.vocab_size_local}) "
            f"but this rank's logits are rows [{layout.vocab_start}, {layout.vocab_start + layout.vocab_size_local}): build it "
            "with this rank's tp_rank and the output layer's V/tp (projection_map.shard_projection)"
        )
    if projection.mapped_rows_end > layout.tokens:
        raise ValueError(
            f"the projection maps student id {projection.mapped_rows_end - 1} but the loss has {layout.tokens} tokens "
            "(its real_vocab_size): padding rows of the output layer would get mass"
        )


def cross_vocab_distill_loss(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    projection: ProjectionShard,
    *,
    loss_type: str,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token divergence between the teacher's top-k (its own vocabulary) and the student projected through ``W``.

    Args:
        student_logits: ``[N, V_s/tp]`` or ``[s, b, V_s/tp]`` logits (fp32, bf16, fp16 or fp64); rank r of
            ``tp_group`` holds student ids ``[r V_s/tp, (r+1) V_s/tp)``.
        teacher_topk_ids: ``[N, K]`` (or ``[s, b, K]``) int64 teacher-vocabulary ids, distinct within a row.
        teacher_topk_logprobs: same shape, the teacher's full-vocabulary log-probs; ``-inf`` marks padding.
        projection: this rank's :class:`ProjectionShard` (:func:`~.projection_map.shard_projection`; its method picks P-KL or
            H-KL).
        loss_type: ``forward_kl``, ``reverse_kl``, ``jsd`` or ``kl_rkl`` (module docstring for the definitions).
        tp_group: tensor-parallel group; ``None`` means the vocabulary is not split (TP=1).
        temperature: student probabilities are ``softmax(student_logits / temperature)``.
        real_vocab_size: student ids at or past it are padding rows (no probability, no gradient).
        **options: the divergence's options (``beta`` for ``jsd``, ``rkl_ratio`` for ``kl_rkl``).

    Returns:
        ``(per_token_loss, metrics)``: the loss ``[N]`` (or ``[s, b]``) in fp32 (fp64 for fp64 logits), neither
        masked nor averaged, and detached per-token metrics: ``student_mass`` (projected student mass on the
        compared ids), ``teacher_mass`` (teacher mass there) and ``unmapped_teacher_mass`` (teacher mass on ids no
        student token reaches, left out of the comparison). Rows with nothing to compare have loss 0, gradient 0.

    Raises:
        ValueError: a loss the method does not allow, unknown options, bad temperature, malformed teacher tensors,
            or a projection shard that does not belong to this rank's logits.
    """
    if not get_divergence(loss_type).cross_tokenizer:  # an unknown name fails here, naming the registered ones
        raise ValueError(f"loss_type={loss_type!r} has no cross-tokenizer form (offered: "
                         f"{', '.join(cross_tokenizer_divergences())}); tcad's support is the student's own top-k, which "
                         "the teacher would have to score through the inverse map")
    for key in ("diagnostics", "token_ids"):
        if key in options:
            raise ValueError(f"option {key!r} of vocab_parallel_distill_loss has no cross-tokenizer form yet")
    divergence_options, _ = split_options(loss_type, options, ())
    temperature = check_temperature(temperature)
    vocab_local = student_logits.shape[-1]
    lead = student_logits.shape[:-1]
    logits = student_logits.reshape(-1, vocab_local)
    layout = ShardLayout.of(tp_group, vocab_local, real_vocab_size)
    loss, metrics = cross_vocab_loss_on_layout(logits, teacher_topk_ids, teacher_topk_logprobs, projection, layout,
                                               loss_type, divergence_options, temperature)
    return loss.reshape(lead), {name: value.reshape(lead) for name, value in metrics.items()}


def cross_vocab_loss_on_layout(
    logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    projection: ProjectionShard,
    layout: ShardLayout,
    loss_type: str,
    divergence_options: Any,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`cross_vocab_distill_loss` on ``[N, V_s/tp]`` logits and a given :class:`ShardLayout` (tests build one
    layout per simulated rank)."""
    check_projection(projection, layout)
    teacher: TeacherSupport = prepare_teacher(teacher_topk_ids, teacher_topk_logprobs, logits.shape[0],
                                              projection.teacher_vocab_size, compute_dtype(logits.dtype))
    loss, student_mass, teacher_mass, unmapped = _CrossVocabDistill.apply(
        logits, teacher, projection, layout, loss_type, divergence_options, temperature
    )
    return loss, {"student_mass": student_mass, "teacher_mass": teacher_mass, "unmapped_teacher_mass": unmapped}
