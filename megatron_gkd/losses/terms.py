"""The terms of the step's loss, each written once against the student's logits as one source
(:mod:`.student_logits`: the logit shard or, fused, the hidden states and the output weight).

A term is ``sum(coefficient x per-token loss)`` over one micro-batch and its statistics (sums over the tokens that
carry a coefficient); the step adds the terms and knows none of them::

    part, stats = divergence_term(spec, source, share, mask)             # one teacher's divergence
    part, stats = policy_gradient_term(spec, source, policy, token_ids, behaviour, mask)

``spec``: what the term computes (the trainer's ``LossSpec`` or ``PolicySpec``, read by attribute); ``share``: one
teacher's part of the micro-batch (its rows ``ids``/``logprobs`` ``[b, s, k]`` or ``hidden`` ``[b, s, h_t]``, and
``coefficients`` ``[b, s]``); ``policy``: the policy-gradient inputs (advantages, the teacher's token log-probs,
``pi_old``, coefficients); ``mask``: ``[b, s]`` the tokens the loss reads.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_gkd.losses.combinations import token_advantages
from megatron_gkd.losses.hidden import hidden_topk
from megatron_gkd.losses.policy_gradient import PolicyGradientOptions, policy_gradient_from_logprobs
from megatron_gkd.losses.student_logits import StudentLogits


def masked_sums(metrics: dict, mask: torch.Tensor) -> dict:
    """Each ``[b, s]`` metric summed over ``mask`` in float64."""
    return {key: torch.where(mask, value, torch.zeros_like(value)).sum().double() for key, value in metrics.items()}


def divergence_term(spec, source: StudentLogits, share, mask: torch.Tensor, *, head: torch.Tensor | None = None,
                    token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """One teacher's ``sum(coefficient x divergence)`` over the micro-batch and its statistics: ``loss``, the summed
    metrics, ``weighted`` (``[b, s]`` detached ``coefficient x divergence``), ``coverage`` (TCAD) and, with
    ``token_ids`` ``[b, s]``, ``token_logprobs``: their differentiable log-probs from the same pass.

    ``head``: this rank's shard of the teacher's output layer, for a teacher that sends hidden states.
    """
    if spec.signal.sends_hidden:
        assert head is not None, f"teacher {share.name!r} sends hidden states but this rank has no head for it"
        if spec.projection is None or spec.hidden_support.whole_vocabulary:
            return _hidden_divergence(spec, source, share, head, mask)  # the teacher's whole distribution
        share = _hidden_rows(spec, share, head, source.tp_group)  # a cross-tokenizer teacher's exact top-k
    common = dict(loss_type=spec.loss_type, temperature=spec.temperature, real_vocab_size=spec.real_vocab_size,
                  **spec.options)
    if spec.projection is not None:  # a teacher of another tokenizer: its rows hold its own ids
        per_token, metrics = source.cross_vocab(share.ids, share.logprobs, spec.projection, **common)
    else:
        per_token, metrics = source.distill(share.ids, share.logprobs, token_ids=token_ids,
                                            diagnostics=spec.diagnostics, tail_bucket=spec.tail_bucket, **common)
    sampled = metrics.pop("token_logprobs", None)
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    coefficients = share.coefficients.to(dtype=per_token.dtype)
    contribution = (per_token * coefficients).sum()
    stats = {"loss": contribution.detach().double(), **masked_sums(metrics, mask & (coefficients != 0)),
             "weighted": (per_token * coefficients).detach()}
    if spec.coverage_coef is not None and "student_mass" in metrics:
        leak = -torch.log(metrics["student_mass"].clamp_min(1e-30))
        stats["coverage"] = (torch.where(mask, leak, torch.zeros_like(leak)) * coefficients).sum().double() \
            * spec.coverage_coef
    if sampled is not None:
        stats["token_logprobs"] = sampled
    return contribution, stats


def _hidden_rows(spec, share, head: torch.Tensor, tp_group):
    """A cross-tokenizer teacher's hidden states as top-k rows of its own vocabulary (exact log-probs, computed with
    its head shard over TP); a position without a teacher row (all-zero hidden state: inside a group, or not
    aligned) gets an empty row."""
    ids, logprobs = hidden_topk(share.hidden, head, spec.teacher_top_k, tp_group=tp_group,
                                teacher_temperature=spec.teacher_temperature,
                                real_vocab_size=spec.teacher_real_vocab_size, chunk_size=spec.chunk_size)
    present = (share.hidden != 0).any(dim=-1, keepdim=True)
    logprobs = torch.where(present, logprobs.float(), torch.full_like(logprobs, float("-inf"), dtype=torch.float32))
    return dataclasses.replace(share, ids=torch.where(present, ids, torch.zeros_like(ids)), logprobs=logprobs)


def _hidden_divergence(spec, source: StudentLogits, share, head: torch.Tensor, mask: torch.Tensor):
    """The exact full-vocabulary divergence from the teacher's hidden states. A teacher of another tokenizer
    (``hidden_support=full``, unfused) is compared with the student projected through ``W``; a position it sent no
    hidden state for (all zero: inside a group, or unaligned) is not compared."""
    if spec.projection is not None:
        mask = mask & (share.hidden != 0).any(dim=-1)
    weights = torch.where(mask, share.coefficients, torch.zeros_like(share.coefficients))
    contribution, per_token, metrics = source.hidden(
        share.hidden, head, weights, loss_type=spec.loss_type, projection=spec.projection,
        teacher_real_vocab_size=spec.teacher_real_vocab_size, temperature=spec.temperature,
        teacher_temperature=spec.teacher_temperature, real_vocab_size=spec.real_vocab_size, **spec.options)
    return contribution, {"loss": contribution.detach().double(), **masked_sums(metrics, weights != 0),
                          "weighted": (per_token * weights.to(per_token.dtype)).detach()}


def policy_gradient_term(spec, source: StudentLogits, policy, token_ids: torch.Tensor, behaviour: torch.Tensor,
                         mask: torch.Tensor, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The policy-gradient term ``sum(coefficient x pg loss)`` over the micro-batch and its statistics (``pg/*``, and
    ``token_logprobs``: the sampled tokens' detached log-probs at the policy's temperature).

    The sampled tokens' log-probs come from ``source`` (or ``sampled`` ``[b, s]``: already taken in a divergence's
    pass); ``behaviour``: the rollout engine's, for truncated importance sampling.
    """
    logprobs = sampled if sampled is not None else source.token_logprobs(token_ids, temperature=spec.temperature,
                                                                         real_vocab_size=spec.real_vocab_size)
    # pi_old: recorded before the first of several updates (outside the loss mask: ratio 1); None: this update
    # starts from the weights that pi_old is, the ratio is 1. The advantages read pi_old: fixed over the updates.
    old = None if policy.old_logprobs is None else torch.where(mask, policy.old_logprobs.to(logprobs.dtype),
                                                                logprobs.detach())
    advantages, kl = token_advantages(spec.combination, policy.advantages, logprobs.detach() if old is None else old,
                                      policy.teacher_logprobs, kd_coef=policy.kd_coef, estimator=spec.estimator,
                                      teacher_baseline=policy.teacher_baseline)
    options = PolicyGradientOptions.of(spec.options)
    behaviour = behaviour.to(logprobs.dtype) if options.tis_cap is not None else None
    per_token, metrics = policy_gradient_from_logprobs(logprobs, torch.where(mask, advantages, 0.0), old, behaviour,
                                                       options)
    zero = torch.zeros_like(per_token)
    per_token = torch.where(mask, per_token, zero)
    contribution = (per_token * policy.coefficients.to(per_token.dtype)).sum()

    def total(value: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, value.to(zero.dtype), zero).sum().double()

    ratio = metrics["ratio"].to(zero.dtype)
    stats = {"pg/loss": contribution.detach().double(), "pg/tokens": mask.sum().double(),
             "pg/advantage": total(advantages), "pg/clipped": total(metrics["clipped"]),
             "pg/ratio": total(ratio), "pg/ratio_max": torch.where(mask, ratio, -math.inf).max().double(),
             "pg/ratio_min": torch.where(mask, ratio, math.inf).min().double(),
             "token_logprobs": logprobs.detach()}
    if kl is not None:
        stats["pg/teacher_kl"] = total(kl)
    if "tis_weight" in metrics:
        stats["pg/tis_weight"] = total(metrics["tis_weight"])
    return contribution, stats
