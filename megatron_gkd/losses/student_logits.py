"""The student's logits as one source for every term of the loss.

The last pipeline stage has the student's logits in one of two forms: the shard ``[s, b, V/tp]`` that the output
layer made (:class:`LogitShard`), or, fused, the final hidden states ``[b, s, h]`` and this rank's rows of the
output weight, from which chunks of logits are recomputed and never kept (:class:`FusedLogits`). A term asks its
source, in the batch's ``[b, s]`` layout, for what it needs (the sampled tokens' log-probs, a divergence against
teacher rows, against a teacher of another tokenizer, against a teacher's hidden states); the source picks the
kernel and the layout, so a term is written once for both::

    source = LogitShard(logits, tp_group, chunk_size=1024)          # or FusedLogits(hidden, weight, tp_group, ...)
    logprobs = source.token_logprobs(token_ids, temperature=1.0)   # [b, s], differentiable
    per_token, metrics = source.distill(teacher_ids, teacher_logprobs, loss_type="forward_kl")

Every method returns ``[b, s]`` tensors (a hidden-state divergence also its weighted total); none masks or weighs
but the hidden-state one, which skips the tokens of weight 0 (their teacher rows are never read).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_gkd.losses.cross_vocab.fused import fused_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.hidden import hidden_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.loss import cross_vocab_distill_loss
from megatron_gkd.losses.fused import fused_vocab_parallel_distill_loss
from megatron_gkd.losses.hidden import hidden_distill_loss
from megatron_gkd.losses.token_logprobs import fused_vocab_parallel_token_logprobs, vocab_parallel_token_logprobs
from megatron_gkd.losses.vocab_parallel import vocab_parallel_distill_loss


def _batch_major(per_token: torch.Tensor, metrics: dict) -> tuple[torch.Tensor, dict]:
    """``[s, b]`` results of a kernel that read the ``[s, b, V/tp]`` shard, in the batch's ``[b, s]`` layout."""
    return per_token.transpose(0, 1), {key: value.transpose(0, 1) for key, value in metrics.items()}


@dataclasses.dataclass(frozen=True)
class LogitShard:
    """The logits ``[s, b, V/tp]`` as the output layer made them (sequence-major: a transposed copy of the step's
    largest tensor is never made).

    Attributes:
        logits: this rank's vocabulary shard.
        tp_group: the tensor-parallel group the vocabulary is split over; None: not split.
        chunk_size: tokens per chunk where a term recomputes logits (a teacher's, from its hidden states).
    """

    logits: torch.Tensor
    tp_group: dist.ProcessGroup | None
    chunk_size: int = 1024

    def token_logprobs(self, token_ids: torch.Tensor, *, temperature: float = 1.0,
                       real_vocab_size: int | None = None) -> torch.Tensor:
        """``[b, s]`` differentiable ``log softmax(logits / temperature)`` of ``token_ids`` ``[b, s]``."""
        return vocab_parallel_token_logprobs(self.logits, token_ids.transpose(0, 1), self.tp_group,
                                             temperature=temperature, real_vocab_size=real_vocab_size).transpose(0, 1)

    def distill(self, ids: torch.Tensor, logprobs: torch.Tensor, *, loss_type: str, token_ids: torch.Tensor | None = None,
                **options) -> tuple[torch.Tensor, dict]:
        """The per-token divergence ``[b, s]`` against the teacher's top-k rows ``[b, s, k]`` and its metrics (with
        ``token_ids``, also ``token_logprobs``: theirs, from the same read of the shard);
        :func:`~megatron_gkd.losses.vocab_parallel_distill_loss`'s options."""
        riding = {} if token_ids is None else {"token_ids": token_ids.transpose(0, 1)}
        return _batch_major(*vocab_parallel_distill_loss(self.logits, ids.transpose(0, 1), logprobs.transpose(0, 1),
                                                         loss_type=loss_type, tp_group=self.tp_group, **riding,
                                                         **options))

    def cross_vocab(self, ids: torch.Tensor, logprobs: torch.Tensor, projection, *, loss_type: str,
                    **options) -> tuple[torch.Tensor, dict]:
        """The per-token divergence ``[b, s]`` against a teacher of another tokenizer (its rows hold its own ids),
        the student projected through ``projection`` (:func:`~megatron_gkd.losses.cross_vocab_distill_loss`)."""
        return _batch_major(*cross_vocab_distill_loss(self.logits, ids.transpose(0, 1), logprobs.transpose(0, 1),
                                                      projection, loss_type=loss_type, tp_group=self.tp_group,
                                                      **options))

    def hidden(self, teacher_hidden: torch.Tensor, head: torch.Tensor, weights: torch.Tensor, *, loss_type: str,
               projection=None, teacher_real_vocab_size: int | None = None,
               **options) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(sum(weights x divergence), per-token divergence [b, s], metrics)`` against the teacher's exact
        distribution from its hidden states ``[b, s, h_t]`` and its output-layer shard ``head``; with ``projection``,
        a teacher of another tokenizer (:func:`~megatron_gkd.losses.hidden_cross_vocab_distill_loss`)."""
        common = dict(loss_type=loss_type, tp_group=self.tp_group, chunk_size=self.chunk_size, **options)
        if projection is not None:
            total, per_token, metrics = hidden_cross_vocab_distill_loss(
                self.logits, teacher_hidden.transpose(0, 1), head, projection, weights.transpose(0, 1),
                teacher_real_vocab_size=teacher_real_vocab_size, **common)
        else:
            total, per_token, metrics = hidden_distill_loss(self.logits, teacher_hidden.transpose(0, 1), head,
                                                            weights.transpose(0, 1), **common)
        return (total, *_batch_major(per_token, metrics))


@dataclasses.dataclass(frozen=True)
class FusedLogits:
    """The final hidden states ``[b, s, h]`` (as ``GPTModel`` returns them) and this rank's rows ``[V/tp, h]`` of the
    output weight: each term recomputes its logits chunk by chunk and keeps none.

    Attributes:
        states, weight: the hidden states (the same on every rank of ``tp_group``) and the output weight's shard (the
            embedding's when tied).
        tp_group: as :class:`LogitShard`'s.
        sequence_parallel: the hidden states were gathered along the sequence (their gradient is reduce-scattered
            there, not all-reduced by the kernels).
        chunk_size: tokens per chunk.
    """

    states: torch.Tensor
    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    sequence_parallel: bool = False
    chunk_size: int = 1024

    @property
    def _chunks(self) -> dict:
        return {"chunk_size": self.chunk_size, "all_reduce_hidden_grad": not self.sequence_parallel}

    def token_logprobs(self, token_ids: torch.Tensor, *, temperature: float = 1.0,
                       real_vocab_size: int | None = None) -> torch.Tensor:
        """As :meth:`LogitShard.token_logprobs`."""
        return fused_vocab_parallel_token_logprobs(self.states, self.weight, token_ids, self.tp_group,
                                                   temperature=temperature, real_vocab_size=real_vocab_size,
                                                   **self._chunks)

    def distill(self, ids: torch.Tensor, logprobs: torch.Tensor, *, loss_type: str, token_ids: torch.Tensor | None = None,
                **options) -> tuple[torch.Tensor, dict]:
        """As :meth:`LogitShard.distill` (``diagnostics`` is refused: the logits never exist in full)."""
        riding = {} if token_ids is None else {"token_ids": token_ids}
        return fused_vocab_parallel_distill_loss(self.states, self.weight, ids, logprobs, loss_type=loss_type,
                                                 tp_group=self.tp_group, **self._chunks, **riding, **options)

    def cross_vocab(self, ids: torch.Tensor, logprobs: torch.Tensor, projection, *, loss_type: str,
                    **options) -> tuple[torch.Tensor, dict]:
        """As :meth:`LogitShard.cross_vocab`."""
        return fused_cross_vocab_distill_loss(self.states, self.weight, ids, logprobs, projection, loss_type=loss_type,
                                              tp_group=self.tp_group, **self._chunks, **options)

    def hidden(self, teacher_hidden: torch.Tensor, head: torch.Tensor, weights: torch.Tensor, *, loss_type: str,
               projection=None, teacher_real_vocab_size: int | None = None,
               **options) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """As :meth:`LogitShard.hidden`, without ``projection`` (a cross-tokenizer teacher's whole distribution reads
        the logit shard; the config checks refuse it fused)."""
        assert projection is None, "hidden_support=full reads the student's logit shard, never built when fused"
        return hidden_distill_loss(self.states, teacher_hidden, head, weights, loss_type=loss_type, tp_group=self.tp_group,
                                   student_weight=self.weight, **self._chunks, **options)


StudentLogits = LogitShard | FusedLogits
"""Where a term reads the student's logits from."""
