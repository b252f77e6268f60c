"""Vocab-parallel losses over the student's logit shard: distillation (GKD family, TCAD, hidden signal), the
policy-gradient term and its helpers, unfused and fused.

Public API::

    loss, metrics = vocab_parallel_distill_loss(logits_shard, teacher_ids, teacher_logprobs,
                                                loss_type="forward_kl", tp_group=tp_group)
    loss, metrics = fused_vocab_parallel_distill_loss(hidden, output_weight_shard, teacher_ids,
                                                      teacher_logprobs, loss_type=..., tp_group=...)
    total, loss, metrics = hidden_distill_loss(student_hidden, teacher_hidden, teacher_head_shard, weights,
                                               student_weight=output_weight_shard, loss_type=..., tp_group=...)
    total, loss, metrics = hidden_cross_vocab_distill_loss(logits_shard, teacher_hidden, teacher_head_shard,
                                                           projection_shard, weights, loss_type=..., tp_group=...)
    logprobs = hidden_token_logprobs(teacher_hidden, teacher_head_shard, token_ids, tp_group=...)  # a sample's check
    logprobs = vocab_parallel_token_logprobs(logits_shard, token_ids, tp_group)  # differentiable; fused_... too
    loss, metrics = vocab_parallel_policy_gradient_loss(logits_shard, token_ids, advantages, tp_group=tp_group,
                                                        old_logprobs=..., behaviour_logprobs=..., clip_low=0.2, ...)
    loss, metrics = fused_vocab_parallel_policy_gradient_loss(hidden, output_weight_shard, token_ids, advantages, ...)

The losses are per token, neither masked nor averaged: the trainer weighs each token by a coefficient fixed over
the global batch (``megatron_gkd.trainer.batch.token_coefficients``).
TCAD: :func:`tcad_support`, :func:`vocab_parallel_topk`, :func:`tcad_sequence_weights`.
New divergences register with :func:`register_divergence`.
Policy gradient: :func:`group_advantages` (GRPO, RLOO, Dr. GRPO), :func:`aggregation_coefficients` (token, sequence
or group-constant aggregation as per-token coefficients), :func:`reverse_kl_estimate` (k1/k3 against a teacher's
token log-probs), :func:`rollout_mismatch` (trainer vs sampler log-probs).
"""

from megatron_gkd.losses.advantages import BatchCounts, aggregation_coefficients, group_advantages
from megatron_gkd.losses.cross_vocab.fused import fused_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.hidden import hidden_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.loss import cross_vocab_distill_loss
from megatron_gkd.losses.fused import fused_vocab_parallel_distill_loss
from megatron_gkd.losses.hidden import hidden_distill_loss, hidden_token_logprobs, hidden_topk
from megatron_gkd.losses.policy_gradient import (
    PolicyGradientOptions,
    fused_vocab_parallel_policy_gradient_loss,
    vocab_parallel_policy_gradient_loss,
)
from megatron_gkd.losses.registry import (
    SupportInputs,
    SupportTerms,
    get_divergence,
    register_divergence,
    registered_divergences,
)
from megatron_gkd.losses.sampled_kl import reverse_kl_estimate, rollout_mismatch
from megatron_gkd.losses.tcad import tcad_sequence_weights, tcad_support
from megatron_gkd.losses.token_logprobs import fused_vocab_parallel_token_logprobs, vocab_parallel_token_logprobs
from megatron_gkd.losses.vocab_parallel import vocab_parallel_distill_loss, vocab_parallel_topk

__all__ = [
    "cross_vocab_distill_loss",
    "fused_cross_vocab_distill_loss",
    "BatchCounts",
    "PolicyGradientOptions",
    "SupportInputs",
    "SupportTerms",
    "aggregation_coefficients",
    "fused_vocab_parallel_distill_loss",
    "fused_vocab_parallel_policy_gradient_loss",
    "fused_vocab_parallel_token_logprobs",
    "get_divergence",
    "group_advantages",
    "hidden_cross_vocab_distill_loss",
    "hidden_distill_loss",
    "hidden_token_logprobs",
    "hidden_topk",
    "register_divergence",
    "registered_divergences",
    "reverse_kl_estimate",
    "rollout_mismatch",
    "tcad_sequence_weights",
    "tcad_support",
    "vocab_parallel_distill_loss",
    "vocab_parallel_policy_gradient_loss",
    "vocab_parallel_token_logprobs",
    "vocab_parallel_topk",
]
