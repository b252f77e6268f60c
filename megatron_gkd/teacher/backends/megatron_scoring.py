"""Scoring with a sharded Megatron-Core teacher: the per-rank function behind ``megatron`` and ``local``.

Every rank of the teacher's model-parallel group calls :meth:`MegatronScorer.score` with the same
batch (a collective). The sequences go through Megatron's forward-only pipeline schedule in micro-batches of several,
right-padded (invisible to the real positions under causal attention), at most ``max_batch_tokens`` padded tokens each.
The last stage's output layer is swapped for the forward (:func:`megatron_gkd.models.output_layer.capture_output_layer`):
the model returns its input, the final hidden states, and the scorer applies the output weight to each sequence's
response rows only, so the ``[b, L, V/tp]`` logits of every position never exist; each sequence's ``[T, V/tp]``
logit shard becomes its TeacherOutput rows without ever gathering the vocabulary:

- log-partition: ``logsumexp`` over the shard, all-gathered over TP (``[T]`` per rank) and combined;
- top-k: :func:`megatron_gkd.losses.vocab_parallel_topk` (local top-k, all-gather of ``[T, k]``);
- the response token and the requested ids (TCAD, different ids per row): each rank reads the ids it
  owns and contributes an exact 0 for the others, summed over TP in the same all-gather as the
  log-partition (:func:`megatron_gkd.losses.shard_ops.combine_shards`).

The rows (row t predicts response token t, from position ``response_start + t - 1``) are then
broadcast from the last stage to the whole model-parallel group, so every rank returns the outputs.
Output-table rows past the tokenizer (padded embeddings) are masked out before normalising.

The hidden signal is that same input of the output layer (after the final norm): replicated over TP without sequence
parallelism, all-gathered along the sequence with it (as the column-parallel output layer itself does). ``[T, h]`` per
sequence is broadcast like the rows.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.losses import vocab_parallel_topk
from megatron_gkd.losses.shard_ops import LocalSupport, ShardLayout, combine_shards
from megatron_gkd.models import load_hf, parallel_state_of, resolve_checkpoint, unwrap
from megatron_gkd.models.output_layer import capture_output_layer
from megatron_gkd.parallel import run_schedule
from megatron_gkd.teacher.backends.forward_groups import forward_groups, padded_length
from megatron_gkd.teacher.protocol.types import ErrorCode, ScoreBatch, SequenceRequest, TeacherError, TeacherOutput

logger = logging.getLogger(__name__)

MAX_BATCH_TOKENS = 8192
"""Padded tokens per micro-batch by default (as the ``hf`` backend's forward passes): the working set is their hidden
states and attention, and one sequence's response logits at a time."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TeacherVocab:
    """Sizes of the teacher's vocabulary.

    Attributes:
        vocab_size: rows of the output layer (all TP shards together; may be padded).
        tokenizer_size: ids the tokenizer defines; rows at or past it get no probability.
        tokenizer_digest: :func:`megatron_gkd.data.tokenization.tokenizer_digest` of the tokenizer.
    """

    vocab_size: int
    tokenizer_size: int
    tokenizer_digest: str


def load_teacher(path: str, dtype: str = "float32", *, state, in_place: bool = True,
                 **config_overrides) -> tuple[list[torch.nn.Module], TeacherVocab]:
    """This rank's teacher chunks (``models.load_hf`` on ``state``, the
    :class:`~megatron_gkd.parallel.ParallelState` to shard it with, ``None`` for the process's; in eval mode) and
    its vocabulary sizes. ``in_place``: the weights the checkpoint stores as they are are its memory map, not copies
    (``load_hf``'s ``in_place``; False only to measure the copy)."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(path, dtype=dtype)  # a GGUF: weights and tokenizer from one conversion
    chunks = load_hf(path, dtype=getattr(torch, dtype), state=state, in_place=in_place, **config_overrides)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = TeacherVocab(vocab_size=int(chunks[0].vocab_size), tokenizer_size=len(tokenizer),
                         tokenizer_digest=tokenizer_digest(tokenizer))
    if vocab.vocab_size != vocab.tokenizer_size:
        logger.info("megatron teacher: %d output rows, %d tokenizer ids; rows past the tokenizer are "
                    "ignored", vocab.vocab_size, vocab.tokenizer_size)
    return chunks, vocab


def score_rows(logits: torch.Tensor, sequence: SequenceRequest, top_k: int, temperature: float,
               tokenizer_size: int, tp_group: dist.ProcessGroup | None,
               hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """TeacherOutput rows of one sequence from the ``[T, V/tp]`` logit shard of its response rows (collective over TP):
    row t is the logits at position ``response_start + t - 1``, which predict response token t.

    Args:
        hidden: the hidden signal: the output layer's input at the same rows ``[T, h]`` (every TP rank); then no
            top-k is computed and ``top_k`` is not read.

    Returns:
        ``token_logprobs`` ``[T]`` and either ``topk_ids`` ``[T, k]``, ``topk_logprobs`` ``[T, k]`` and,
        when ids were requested, ``requested_logprobs`` ``[T, m]``, or (hidden) ``hidden`` ``[T, h]``;
        float32 log-probs and hidden states.
    """
    # fp32 so that bf16 teachers normalise without rounding the log-partition.
    scaled = logits.float() / temperature
    layout = ShardLayout.of(tp_group, scaled.shape[-1])
    if layout.vocab_start + layout.vocab_size_local > tokenizer_size:
        padded = torch.arange(layout.vocab_size_local, device=scaled.device) + layout.vocab_start >= tokenizer_size
        scaled = scaled.masked_fill(padded, float("-inf"))
    # A shard made only of padded rows has lse -inf; logsumexp over ranks then ignores it.
    local_lse = torch.logsumexp(scaled, dim=-1)
    response = torch.as_tensor(sequence.response_ids, device=scaled.device)[:, None]
    support_ids = response
    if sequence.requested_ids is not None:
        support_ids = torch.cat([response, torch.as_tensor(sequence.requested_ids, device=scaled.device)], 1)
    support = LocalSupport.of(support_ids, torch.ones_like(support_ids, dtype=torch.bool), layout)
    lse, support_logits = combine_shards(local_lse, support.gather(scaled, torch.float32), layout)
    if hidden is not None:
        return {"token_logprobs": support_logits[:, 0] - lse, "hidden": hidden.float()}
    ids, values = vocab_parallel_topk(scaled, top_k, tp_group)
    rows = {"topk_ids": ids, "topk_logprobs": values - lse[:, None],
            "token_logprobs": support_logits[:, 0] - lse}
    if sequence.requested_ids is not None:
        rows["requested_logprobs"] = support_logits[:, 1:] - lse[:, None]
    return rows


class MegatronScorer:
    """Scores batches with this rank's chunks of a Megatron-Core teacher (a collective call).

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage), e.g. from :func:`load_teacher`.
        vocab: the teacher's vocabulary sizes.
        device: device of the model's activations (:func:`megatron_gkd.platform.device`).
        max_batch_tokens: padded tokens (sequences x their longest) per micro-batch; a longer sequence is a
            micro-batch of its own.
    """

    def __init__(self, chunks: list[torch.nn.Module], vocab: TeacherVocab, device: torch.device, *,
                 max_batch_tokens: int = MAX_BATCH_TOKENS):
        self.chunks, self.vocab, self.device = chunks, vocab, device
        self.max_batch_tokens = max_batch_tokens
        self.hidden_size = int(unwrap(chunks[0]).config.hidden_size)
        state = parallel_state_of(chunks[0])  # the layout the teacher was loaded on
        self._tp_group = state.tp_group
        sequence_parallel = bool(getattr(unwrap(chunks[0]).config, "sequence_parallel", False))
        self._sequence_multiple = state.tp_size if sequence_parallel else 1
        self._mp_group = state.mp_group
        self._last_stage = state.is_pipeline_last_stage
        self._pipelined = state.pp_size > 1
        # The model-parallel rank whose outputs every rank receives: last stage, TP rank 0.
        owner = dist.get_rank() if self._last_stage and state.tp_rank == 0 else -1
        owner = torch.tensor([owner], dtype=torch.int64, device=device)
        dist.all_reduce(owner, op=dist.ReduceOp.MAX, group=self._mp_group)
        self._owner = int(owner.item())

    def check(self, batch: ScoreBatch, max_top_k: int) -> None:
        """Raises TeacherError for requests this teacher cannot score (same answer on every rank)."""
        if not batch.is_hidden and batch.top_k > max_top_k:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"top_k={batch.top_k} exceeds this teacher's max {max_top_k}")
        for sequence in batch.sequences:
            for what, ids in (("token id", sequence.token_ids), ("requested id", sequence.requested_ids)):
                if ids is not None and ids.size and (int(ids.max()) >= self.vocab.tokenizer_size or int(ids.min()) < 0):
                    raise TeacherError(ErrorCode.BAD_REQUEST, f"{what} {int(ids.max())} is outside the "
                                       f"teacher's vocabulary of {self.vocab.tokenizer_size}")

    @torch.no_grad()
    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        """One TeacherOutput per sequence, on every rank of the model-parallel group."""
        rows = self._forward(batch)
        return self._broadcast(rows, batch)

    def micro_batches(self, lengths: list[int]) -> tuple[list[list[int]], int | None, int]:
        """The sequences' indices per micro-batch, the rows of every micro-batch (``None``: each its own count) and
        the padded length of the longest sequence.

        Pipeline stages exchange fixed-shape activations, so there every micro-batch has the same rows (the last one
        filled with empty rows) at the batch's longest length, the sequences in order. A single stage takes them
        shortest first (a ragged batch then pads little) in
        :func:`~megatron_gkd.teacher.backends.forward_groups.forward_groups`, each micro-batch at its own longest length.
        """
        longest = padded_length(max(lengths), self._sequence_multiple)
        if self._pipelined:
            rows = max(1, min(len(lengths), self.max_batch_tokens // longest))
            return [list(range(first, min(first + rows, len(lengths)))) for first in range(0, len(lengths), rows)], \
                rows, longest
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        groups = forward_groups([lengths[i] for i in order], self.max_batch_tokens, self._sequence_multiple)
        return [[order[i] for i in group] for group in groups], None, longest

    def _forward(self, batch: ScoreBatch) -> list[dict[str, torch.Tensor]]:
        groups, fixed_rows, longest = self.micro_batches([len(s.token_ids) for s in batch.sequences])
        rows: dict[int, dict[str, torch.Tensor]] = {}  # by the sequence's index in the batch (last stage only)

        def forward_step(data_iterator, model):
            indices = next(data_iterator)
            group = [batch.sequences[index] for index in indices]
            length = longest if self._pipelined else padded_length(max(len(s.token_ids) for s in group),
                                                                   self._sequence_multiple)
            tokens = torch.zeros(fixed_rows or len(group), length, dtype=torch.long, device=self.device)
            for row, sequence in enumerate(group):  # right-padded; a pipeline's filler rows stay empty
                tokens[row, :len(sequence.token_ids)] = torch.as_tensor(sequence.token_ids, device=self.device)
            position_ids = torch.arange(length, device=self.device)[None].expand(len(tokens), -1)
            with capture_output_layer(model, self._tp_group) as captured:
                output = model(tokens, position_ids, attention_mask=None)

            def collect(hidden):  # last stage only: the output layer's input [b, L, h]
                for row, (index, sequence) in enumerate(zip(indices, group)):
                    response = hidden[row, sequence.response_start - 1:len(sequence.token_ids) - 1]  # [T, h]
                    rows[index] = score_rows(F.linear(response, captured.weight), sequence, batch.top_k,
                                             batch.temperature, self.vocab.tokenizer_size, self._tp_group,
                                             response if batch.is_hidden else None)
                return hidden.new_zeros(()), {}

            return output, collect

        run_schedule(self.chunks, forward_step, groups, seq_length=longest, micro_batch_size=fixed_rows or 1,
                     forward_only=True)
        return [rows[index] for index in sorted(rows)]

    def _broadcast(self, rows: list[dict[str, torch.Tensor]], batch: ScoreBatch) -> list[TeacherOutput]:
        lengths = [s.num_response_tokens for s in batch.sequences]
        total, m = sum(lengths), batch.num_requested or 0
        k, h = (0, self.hidden_size) if batch.is_hidden else (batch.top_k, 0)
        # Two buffers: int64 ids [N, k]; float32 [N, k + 1 + m + h] = top-k log-probs, token,
        # requested, hidden (k = m = 0 for the hidden signal, h = 0 for the top-k).
        if rows:
            ids = torch.cat([r["topk_ids"] for r in rows]) if k else None
            values = torch.cat([torch.cat([r[key] if r[key].dim() == 2 else r[key][:, None]
                                           for key in ("topk_logprobs", "token_logprobs", "requested_logprobs",
                                                       "hidden") if key in r], 1) for r in rows])
        else:
            ids = torch.empty(total, k, dtype=torch.int64, device=self.device) if k else None
            values = torch.empty(total, k + 1 + m + h, dtype=torch.float32, device=self.device)
        if dist.get_world_size(self._mp_group) > 1:
            if ids is not None:
                dist.broadcast(ids, self._owner, group=self._mp_group)
            dist.broadcast(values, self._owner, group=self._mp_group)
        ids = ids.cpu().numpy() if ids is not None else np.empty((total, 0), np.int64)
        values = values.cpu().numpy()
        outputs, offset = [], 0
        for length in lengths:
            part = slice(offset, offset + length)
            outputs.append(TeacherOutput(
                topk_ids=np.ascontiguousarray(ids[part]), topk_logprobs=np.ascontiguousarray(values[part, :k]),
                token_logprobs=np.ascontiguousarray(values[part, k]),
                requested_logprobs=np.ascontiguousarray(values[part, k + 1:k + 1 + m]) if m else None,
                hidden=np.ascontiguousarray(values[part, k + 1:]) if h else None))
            offset += length
        return outputs
