"""Building blocks shared by the unfused and the fused vocab-parallel paths.

Both paths stream over the ``[N, V/tp]`` logit shard in row chunks that fit in cache, so that no more
than one fp32 chunk buffer exists besides the gradient itself; exponentials are recomputed in the
backward straight into the gradient buffer instead of saving the softmax.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

# Rows per chunk are chosen so a chunk holds about this many elements. On the host 1 MiB of fp32: small
# enough to stay in a core's L2 while several passes run over it, large enough that per-op overhead is
# noise. On an accelerator 128 MiB: every kernel gets enough work that launch overhead is noise (at the
# host's size a 151,936-column shard is one row a chunk, and forward KL over 4096 tokens took 137x the
# floor on an H200, almost all of it kernel launches), and the one chunk buffer stays small beside the
# logits themselves.
HOST_CHUNK_ELEMENTS = 1 << 18
ACCELERATOR_CHUNK_ELEMENTS = 1 << 25


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs are computed in fp64, everything else in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_per_chunk(vocab_size_local: int, device: torch.device) -> int:
    elements = HOST_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // max(1, vocab_size_local))


class WeightGrad:
    """Where a fused backward adds each token chunk's output-weight gradient ``grad_logits^T @ hidden``.

    A weight under Megatron's ``DistributedDataParallel`` carries ``main_grad``, its slice of the fp32 gradient buffer:
    the chunks are added there directly and the backward returns no weight gradient, as Megatron's own layers do with
    gradient-accumulation fusion. Otherwise a ``[V/tp, h]`` weight gradient would exist twice at the backward's peak (the
    returned tensor and DDP's add of it into the buffer; 0.58 GiB each at 152k x 1024 in fp32). Any other path that
    reaches the same weight (a tied embedding's lookup, an unfused term) still returns its gradient, which DDP's hook
    adds as before: a ``None`` adds nothing to it. DDP's hook then does not run for a weight that only this backward
    reached, which is right while gradients are reduced after the backward (``overlap_grad_reduce`` off, as
    ``trainer.optim.wrap_for_training`` wraps).

    Without ``main_grad`` (a loss called outside DDP) the chunks go to a zero buffer in the compute dtype, returned
    in the weight's dtype.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.main_grad = getattr(weight, "main_grad", None)
        self.weight_dtype = weight.dtype
        self.buffer = (self.main_grad if self.main_grad is not None
                       else torch.zeros(weight.shape, dtype=dtype, device=weight.device))

    def add(self, grad_logits: torch.Tensor, inputs: torch.Tensor) -> None:
        """Adds ``grad_logits^T @ inputs`` (``[c, V/tp]``, ``[c, h]``) in one product where the dtypes agree."""
        if grad_logits.dtype == inputs.dtype == self.buffer.dtype:
            self.buffer.addmm_(grad_logits.t(), inputs)
        else:  # narrow inputs: their product, widened by the add
            self.buffer.add_(torch.mm(grad_logits.t(), inputs))

    def result(self) -> torch.Tensor | None:
        """The weight gradient the backward returns: None once it is in ``main_grad``."""
        return None if self.main_grad is not None else self.buffer.to(self.weight_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where this rank's vocabulary shard lies: ids ``[vocab_start, vocab_start + vocab_size_local)``.

    ``real_vocab_size``: ids at or past it are the padding rows of a table longer than the tokenizer
    (Qwen3: 151,669 tokens, 151,936 rows). They are not tokens: no probability, no gradient, never a top-k
    id. ``None``: every row is a token.
    """

    tp_group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int
    vocab_size_local: int
    real_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.real_vocab_size is not None and not 0 < self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size={self.real_vocab_size} must lie in [1, vocabulary size "
                             f"{self.vocab_size}] (the tokenizer's size, at most the rows of the output layer)")

    @classmethod
    def of(cls, tp_group: dist.ProcessGroup | None, vocab_size_local: int,
           real_vocab_size: int | None = None) -> "ShardLayout":
        if tp_group is None:
            return cls(None, 1, 0, vocab_size_local, real_vocab_size)
        return cls(tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group), vocab_size_local, real_vocab_size)

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_size_local

    @property
    def vocab_size(self) -> int:
        return self.tp_size * self.vocab_size_local

    @property
    def tokens(self) -> int:
        """Ids that are tokens (the real vocabulary)."""
        return self.vocab_size if self.real_vocab_size is None else self.real_vocab_size

    @property
    def tokens_local(self) -> int:
        """Columns of this shard that are tokens: ``[0, tokens_local)``; the rest are padding rows."""
        return max(0, min(self.vocab_size_local, self.tokens - self.vocab_start))


@dataclasses.dataclass(frozen=True, slots=True)
class LocalSupport:
    """The teacher ids that fall in this rank's shard.

    Attributes:
        local_index: ``[N, K]`` column in the shard; 0 where ``in_shard`` is false (never used there:
            every read is masked and every write goes through the compacted entries below).
        in_shard: ``[N, K]`` bool, valid entries owned by this rank.
    """

    local_index: torch.Tensor
    in_shard: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor, valid: torch.Tensor, layout: ShardLayout) -> "LocalSupport":
        local = ids - layout.vocab_start
        in_shard = valid & (local >= 0) & (local < layout.vocab_size_local)
        return cls(torch.where(in_shard, local, torch.zeros_like(local)), in_shard)

    def columns(self, width: int) -> "LocalSupport":
        """The first ``width`` support columns (the teacher's ids, without a sampled token riding after them)."""
        return LocalSupport(self.local_index[:, :width], self.in_shard[:, :width])

    def gather(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, K]`` logits at the owned ids in ``dtype``, exactly 0 elsewhere."""
        values = logits.gather(1, self.local_index).to(dtype)
        return torch.where(self.in_shard, values, torch.zeros_like(values))


def all_gather_rows(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """``[tp, *tensor.shape]`` stack of every rank's ``tensor`` (no autograd)."""
    if layout.tp_size == 1:
        return tensor.unsqueeze(0)
    pieces = [torch.empty_like(tensor) for _ in range(layout.tp_size)]
    dist.all_gather(pieces, tensor.contiguous(), group=layout.tp_group)
    return torch.stack(pieces)


def combine_shards(
    local_lse: torch.Tensor, local_support_logits: torch.Tensor, layout: ShardLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``logsumexp`` and support logits from every rank's partial values, in one collective.

    Each support entry is owned by exactly one rank and the others hold an exact 0, so the sum over
    ranks reproduces the owner's value bit for bit.
    """
    stacked = all_gather_rows(torch.cat([local_lse.unsqueeze(-1), local_support_logits], dim=-1), layout)
    return torch.logsumexp(stacked[..., 0], dim=0), stacked[..., 1:].sum(0)


def exp_rows(logits: torch.Tensor, temperature: float, work: torch.Tensor) -> torch.Tensor:
    """Writes ``exp(logits / T - m)`` of one row chunk into ``work`` (same shape, compute dtype), ``m`` each row's
    largest ``logits / T``, and returns ``m`` (``[rows]``, compute dtype): every value is at most 1."""
    row_max = logits.amax(dim=1, keepdim=True)
    if logits.dtype == work.dtype:
        torch.sub(logits, row_max, out=work)
    else:
        work.copy_(logits)  # upcast first: subtracting in bf16 would round
        work.sub_(row_max)
    if temperature != 1.0:
        work.div_(temperature)
    work.exp_()
    return row_max.squeeze(1).to(work.dtype) / temperature


def local_logsumexp_rows(
    logits: torch.Tensor, temperature: float, work: torch.Tensor
) -> torch.Tensor:
    """``logsumexp(logits / T)`` over one row chunk, using ``work`` (same shape, compute dtype) as scratch."""
    return exp_rows(logits, temperature, work) + work.sum(dim=1).log()


def local_logsumexp(logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """``[N]`` ``logsumexp`` of ``logits / T`` over this shard, streamed in cache-sized row chunks
    (``-inf`` for a shard without columns: every row of it padding)."""
    num_rows, vocab_local = logits.shape
    if vocab_local == 0:
        return torch.full((num_rows,), float("-inf"), dtype=dtype, device=logits.device)
    rows = rows_per_chunk(vocab_local, logits.device)
    work = torch.empty(min(rows, num_rows), vocab_local, dtype=dtype, device=logits.device)
    out = torch.empty(num_rows, dtype=dtype, device=logits.device)
    for start in range(0, num_rows, rows):
        stop = min(start + rows, num_rows)
        out[start:stop] = local_logsumexp_rows(logits[start:stop], temperature, work[: stop - start])
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SparseGrad:
    """The support part of the gradient, compacted to the entries this rank owns, sorted by row.

    Entries are addressed by their flat position ``row * V/tp + column`` in the ``[N, V/tp]`` gradient;
    a row chunk starting at ``start`` subtracts ``start * V/tp`` once.

    ``replace``: the entries are the whole gradient there and overwrite the dense part instead of adding to it (the
    tail bucket's, whose dense coefficient is exact outside the support only, :mod:`.tail`); ``then``: entries added
    after these.
    """

    flat_index: torch.Tensor
    values: torch.Tensor
    row_offsets: list[int]  # entries of rows [a, b) are [row_offsets[a], row_offsets[b])
    replace: bool = False
    then: "SparseGrad | None" = None

    @classmethod
    def of(cls, support: LocalSupport, grad_support: torch.Tensor, vocab_size_local: int, *, replace: bool = False,
           then: "SparseGrad | None" = None) -> "SparseGrad":
        # Boolean-mask selection keeps row-major order: entries come sorted by row.
        counts = support.in_shard.sum(dim=1)
        rows = torch.arange(counts.numel(), device=counts.device).repeat_interleave(counts)
        flat_index = rows * vocab_size_local + support.local_index[support.in_shard]
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        offsets[1:] = counts.cumsum(0).cpu()  # one host sync per call, none per chunk
        return cls(flat_index, grad_support[support.in_shard], offsets.tolist(), replace, then)

    def add_to_rows(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Adds (``replace``: writes) the entries of rows ``[start, stop)`` into ``out`` (those rows, contiguous),
        then those of ``then``."""
        first, last = self.row_offsets[start], self.row_offsets[stop]
        if first != last:
            flat = self.flat_index[first:last] - start * out.shape[1]
            values = self.values[first:last].to(out.dtype)
            if self.replace:  # ids are distinct within a row: no entry is written twice
                out.view(-1).index_copy_(0, flat, values)
            else:
                out.view(-1).index_add_(0, flat, values)
        if self.then is not None:
            self.then.add_to_rows(out, start, stop)


def write_grad_rows(
    logits: torch.Tensor,
    shift: torch.Tensor,
    dense_scale: torch.Tensor,
    temperature: float,
    out: torch.Tensor,
) -> None:
    """``out = dense_scale * exp((logits - shift) / T)`` for one row chunk; ``out`` may alias ``logits``.

    ``shift`` (``lse * T``) and ``dense_scale`` are ``[rows, 1]`` columns.
    """
    if logits.dtype == out.dtype:
        torch.sub(logits, shift, out=out)
    else:
        out.copy_(logits)
        out.sub_(shift)
    if temperature != 1.0:
        out.div_(temperature)
    out.exp_()
    out.mul_(dense_scale)


def logits_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    dense_scale: torch.Tensor,
    sparse: SparseGrad,
    temperature: float,
    dtype: torch.dtype,
    tokens_local: int | None = None,
) -> torch.Tensor:
    """The full ``[N, V/tp]`` gradient in ``logits.dtype``: dense softmax part plus the sparse support part.

    Written chunk by chunk straight into the result; a separate compute-dtype chunk buffer is used only
    when the logits are in a narrower dtype (the support part is added before rounding). Columns from
    ``tokens_local`` on (padding rows) get an exact 0.
    """
    num_rows, vocab_local = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if not bool(dense_scale.ne(0).any()):
        # No dense part (reverse_kl, jsd, or every token masked): zeros plus the support entries. The
        # entries land on zeros, so rounding them to a narrow dtype here rounds each value once.
        grad.zero_()
        sparse.add_to_rows(grad, 0, num_rows)
        return grad
    rows = rows_per_chunk(vocab_local, logits.device)
    work = None if grad.dtype == dtype else torch.empty(min(rows, num_rows), vocab_local, dtype=dtype,
                                                        device=logits.device)
    shift, dense_scale = (lse * temperature).unsqueeze(1), dense_scale.unsqueeze(1)
    for start in range(0, num_rows, rows):
        stop = min(start + rows, num_rows)
        out = grad[start:stop] if work is None else work[: stop - start]
        write_grad_rows(logits[start:stop], shift[start:stop], dense_scale[start:stop], temperature, out)
        zero_padding_columns(out, tokens_local)
        sparse.add_to_rows(out, start, stop)
        if work is not None:
            grad[start:stop].copy_(out)
    return grad


def zero_padding_columns(out: torch.Tensor, tokens_local: int | None) -> None:
    """Sets the columns of ``out`` from ``tokens_local`` on (padding rows of the table) to 0."""
    if tokens_local is not None and tokens_local < out.shape[1]:
        out[:, tokens_local:] = 0


def check_token_ids(token_ids: torch.Tensor, num_rows: int, num_tokens: int) -> torch.Tensor:
    """``token_ids`` flattened to ``[N]`` int64, refusing what is not one token per row.

    Raises:
        ValueError: not an integer tensor, not one id per row, or an id outside ``[0, num_tokens)``.
    """
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor (int64), got {token_ids.dtype}")
    ids = token_ids.reshape(-1).long()
    if ids.numel() != num_rows:
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must hold one id per row of the logits ({num_rows} rows: "
                         "[N] with [N, V/tp], or [s, b] with [s, b, V/tp])")
    if ids.numel():
        low, high = torch.stack([ids.min(), ids.max()]).tolist()  # one host sync
        if low < 0 or high >= num_tokens:
            raise ValueError(
                f"token_ids must be tokens, in [0, {num_tokens}) (V/tp x tp, or real_vocab_size when the table has "
                f"padding rows); got ids in [{low}, {high}]. Give positions outside the loss any token (e.g. 0) and a "
                "coefficient of 0"
            )
    return ids
