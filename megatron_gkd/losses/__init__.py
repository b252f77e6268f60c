"""Vocab-parallel distillation losses (GKD family and TCAD), their TCAD helpers and the fused path.

Public API::

    loss, metrics = vocab_parallel_distill_loss(logits_shard, teacher_ids, teacher_logprobs,
                                                loss_type="forward_kl", tp_group=tp_group)
    loss, metrics = fused_vocab_parallel_distill_loss(hidden, output_weight_shard, teacher_ids,
                                                      teacher_logprobs, loss_type=..., tp_group=...)
    total, loss, metrics = hidden_distill_loss(student_hidden, teacher_hidden, teacher_head_shard, weights,
                                               student_weight=output_weight_shard, loss_type=..., tp_group=...)
    logprobs = hidden_token_logprobs(teacher_hidden, teacher_head_shard, token_ids, tp_group=...)  # a sample's check

The losses are per token, neither masked nor averaged: the trainer weighs each token by a coefficient fixed over
the global batch (``megatron_gkd.trainer.batch.token_coefficients``).
TCAD: :func:`tcad_support`, :func:`vocab_parallel_topk`, :func:`tcad_sequence_weights`.
New divergences register with :func:`register_divergence`.
"""

from megatron_gkd.losses.fused import fused_vocab_parallel_distill_loss
from megatron_gkd.losses.hidden import hidden_distill_loss, hidden_token_logprobs
from megatron_gkd.losses.registry import (
    SupportInputs,
    SupportTerms,
    get_divergence,
    register_divergence,
    registered_divergences,
)
from megatron_gkd.losses.tcad import tcad_sequence_weights, tcad_support
from megatron_gkd.losses.vocab_parallel import vocab_parallel_distill_loss, vocab_parallel_topk

__all__ = [
    "SupportInputs",
    "SupportTerms",
    "fused_vocab_parallel_distill_loss",
    "get_divergence",
    "hidden_distill_loss",
    "hidden_token_logprobs",
    "register_divergence",
    "registered_divergences",
    "tcad_sequence_weights",
    "tcad_support",
    "vocab_parallel_distill_loss",
    "vocab_parallel_topk",
]
