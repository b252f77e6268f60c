"""The policy-gradient term: a per-token loss over the student's TP-sharded logits, unfused or fused.

Per response token ``y_t`` with advantage ``A_t`` (the sequence's, see :mod:`.advantages`, later minus a
distillation term), ``log pi = log pi_theta(y_t)`` from :mod:`.token_logprobs` and ``ratio = exp(log pi - log
pi_old)``::

    loss_t = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))       # PPO's clipped surrogate
    loss_t = min(loss_t, -A clip_ratio_c)                    if A < 0 and clip_ratio_c (dual clip)
    loss_t = loss_t x min(exp(log pi_old - log pi_behaviour), tis_cap)        if tis_cap (weight detached)

* ``log pi_old``: the policy the ratio is taken against: the trainer's log-probs of the samples before this
  update (a no-grad forward), or the rollout engine's when the trainer does not recompute them. ``None``: one
  update per rollout with no recompute: ``log pi.detach()`` (ratio 1, gradient ``-A grad log pi``).
* Truncated importance sampling (``tis_cap``): the sampler (vLLM, other kernels and precision) is not exactly
  the trainer; the detached weight ``min(pi_old / pi_behaviour, cap)`` corrects the sampling distribution
  without letting a rare token's weight explode.

Like the divergences the loss is per token, neither masked nor averaged: the trainer weighs each token by a
coefficient fixed over the global batch (:func:`~megatron_gkd.losses.advantages.aggregation_coefficients`), so the
term sums with the divergences over the same logits and layouts and micro-batching stay exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_gkd.losses.token_logprobs import fused_vocab_parallel_token_logprobs, vocab_parallel_token_logprobs
from megatron_gkd.registry import closest

# Log-probs a little above 0 come from rounding (bf16 transport); clearly positive values are not log-probs.
_MAX_LOGPROB = 1e-2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyGradientOptions:
    """Options of the policy-gradient term.

    Attributes:
        clip_low: the ratio is clipped below at ``1 - clip_low`` (PPO's epsilon), in ``[0, 1)``.
        clip_high: the ratio is clipped above at ``1 + clip_high`` (DAPO raises it above ``clip_low`` so that
            unlikely tokens with a positive advantage can still grow), ``>= 0``.
        clip_ratio_c: dual clip (Ye et al., 2020): with a negative advantage the loss is at most ``-A c``, so a
            huge ratio cannot push a token down without bound; ``> 1``, ``None``: off.
        tis_cap: truncated importance sampling's cap on ``pi_old / pi_behaviour``, ``> 0``; ``None``: off (then
            ``behaviour_logprobs`` only feed the metrics).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"option clip_low={self.clip_low} must lie in [0, 1) (the ratio is clipped at "
                             "1 - clip_low)")
        if not self.clip_high >= 0:
            raise ValueError(f"option clip_high={self.clip_high} must be >= 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"option clip_ratio_c={self.clip_ratio_c} must be > 1 (or None: no dual clip)")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"option tis_cap={self.tis_cap} must be > 0 (or None: no importance weight)")

    @classmethod
    def of(cls, options: dict[str, Any]) -> "PolicyGradientOptions":
        """Builds the options from keywords, naming an unknown key and the closest valid one.

        Raises:
            ValueError: an unknown option or an invalid value.
        """
        valid = [field.name for field in dataclasses.fields(cls)]
        for key in options:
            if key not in valid:
                raise ValueError(f"the policy-gradient term has no option {key!r}{closest(key, valid)} "
                                 f"(its options: {', '.join(valid)})")
        return cls(**options)


def _per_token(name: str, value: torch.Tensor | None, num_rows: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """``value`` flattened to ``[N]`` in ``dtype``, or None."""
    if value is None:
        return None
    if value.numel() != num_rows:
        raise ValueError(f"{name} {tuple(value.shape)} must hold one value per token ({num_rows})")
    return value.reshape(-1).to(device=device, dtype=dtype)


def _validate(advantages: torch.Tensor, old: torch.Tensor | None, behaviour: torch.Tensor | None) -> None:
    """Refuses what cannot be advantages or log-probs of sampled tokens (one host sync for every check)."""
    nothing = torch.zeros((), dtype=torch.bool, device=advantages.device)
    checks = {
        "advantages are not finite": ~torch.isfinite(advantages).all(),
        # A sampled token has a finite log-prob under the policy it is compared with; -inf would make the ratio inf.
        "old_logprobs are not finite": nothing if old is None else ~torch.isfinite(old).all(),
        "old_logprobs are positive": nothing if old is None else (old > _MAX_LOGPROB).any(),
        # The sampler's -inf (a token its own numerics ruled out) only saturates the importance weight at its cap.
        "behaviour_logprobs have NaN": nothing if behaviour is None else behaviour.isnan().any(),
        "behaviour_logprobs are positive": nothing if behaviour is None else (behaviour > _MAX_LOGPROB).any(),
    }
    failed = [message for message, flag in zip(checks, torch.stack(list(checks.values())).tolist()) if flag]
    if failed:
        raise ValueError(f"malformed policy-gradient inputs: {'; '.join(failed)} (old and behaviour log-probs are the "
                         "full-vocabulary log-probabilities of the sampled tokens)")


def policy_gradient_terms(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    options: PolicyGradientOptions,
    old_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss of the module docstring from ``[N]`` log-probs (differentiable through ``logprobs``).

    Args:
        logprobs: ``[N]`` the trainer's current log-probs of the sampled tokens, in the compute dtype.
        advantages, old_logprobs, behaviour_logprobs: ``[N]`` in the same dtype (validated by the caller).
        options: clipping and importance-sampling options.

    Returns:
        ``(loss [N], metrics)``: detached per-token ``ratio``, ``clipped`` (1 where clipping zeroes the gradient)
        and, with ``tis_cap``, ``tis_weight``.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    surrogate = -advantages * ratio
    clipped_surrogate = -advantages * ratio.clamp(1.0 - options.clip_low, 1.0 + options.clip_high)
    loss = torch.maximum(surrogate, clipped_surrogate)
    clipped = clipped_surrogate > surrogate  # the constant branch won: no gradient
    if options.clip_ratio_c is not None:
        bound = -advantages * options.clip_ratio_c
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    metrics = {"ratio": ratio.detach(), "clipped": clipped.to(loss.dtype)}
    if options.tis_cap is not None:
        # Detached: it reweights the sampling distribution, it is not a function of the parameters.
        weight = torch.exp(old.detach() - behaviour_logprobs).clamp(max=options.tis_cap).detach()
        loss = loss * weight
        metrics["tis_weight"] = weight
    return loss, metrics


def policy_gradient_from_logprobs(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    options: PolicyGradientOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss from log-probs already taken (e.g. once for the loss and the advantage of the same pass):
    validates the inputs (any shape, one value per token) and applies :func:`policy_gradient_terms`.

    Returns:
        As :func:`vocab_parallel_policy_gradient_loss`, in the shape of ``logprobs``.
    """
    lead, flat = logprobs.shape, logprobs.reshape(-1)
    advantages, old, behaviour = (_per_token(name, value, flat.numel(), flat.dtype, flat.device) for name, value in
                                  (("advantages", advantages), ("old_logprobs", old_logprobs),
                                   ("behaviour_logprobs", behaviour_logprobs)))
    if options.tis_cap is not None and behaviour is None:
        raise ValueError("option tis_cap needs behaviour_logprobs (the rollout engine's log-probs of the tokens)")
    _validate(advantages, old, behaviour)
    loss, metrics = policy_gradient_terms(flat, advantages, options, old, behaviour)
    metrics["logprobs"] = flat.detach()
    return loss.reshape(lead), {name: value.reshape(lead) for name, value in metrics.items()}


def vocab_parallel_policy_gradient_loss(
    logits_shard: torch.Tensor,
    token_ids: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    old_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy-gradient loss on this rank's vocabulary shard (no vocabulary gather).

    Args:
        logits_shard: ``[N, V/tp]`` or ``[s, b, V/tp]`` logits; rank r of ``tp_group`` holds ids
            ``[r V/tp, (r+1) V/tp)``.
        token_ids: ``[N]`` (or ``[s, b]``) the sampled tokens (each row's logits predict its token).
        advantages: same shape, the advantage of each token (0 at positions outside the loss is fine).
        tp_group: tensor-parallel group; ``None``: the vocabulary is not split.
        old_logprobs: same shape, ``log pi_old`` (see the module docstring), or None.
        behaviour_logprobs: same shape, the rollout engine's log-probs of the tokens (needed with ``tis_cap``).
        temperature: the sampling temperature: ``pi = softmax(logits / temperature)``.
        real_vocab_size: ids at or past it are padding rows of the table (no probability, no gradient).
        **options: :class:`PolicyGradientOptions` (``clip_low``, ``clip_high``, ``clip_ratio_c``, ``tis_cap``).

    Returns:
        ``(per_token_loss, metrics)``: the loss in fp32 (fp64 for fp64 logits), neither masked nor averaged, and
        detached per-token ``logprobs``, ``ratio``, ``clipped`` (and ``tis_weight``), all in the tokens' shape.

    Raises:
        ValueError: an unknown or invalid option, ids that are not tokens, malformed log-probs or advantages.
    """
    built = PolicyGradientOptions.of(options)
    logprobs = vocab_parallel_token_logprobs(logits_shard, token_ids, tp_group, temperature=temperature,
                                             real_vocab_size=real_vocab_size)
    return policy_gradient_from_logprobs(logprobs, advantages, old_logprobs, behaviour_logprobs, built)


def fused_vocab_parallel_policy_gradient_loss(
    hidden: torch.Tensor,
    output_weight_shard: torch.Tensor,
    token_ids: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    old_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
    chunk_size: int | None = None,
    all_reduce_hidden_grad: bool = True,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`vocab_parallel_policy_gradient_loss` of ``hidden @ output_weight_shard^T``, chunked over tokens.

    Args:
        hidden: ``[N, h]`` or ``[s, b, h]`` last hidden states, the same on every rank of ``tp_group``.
        output_weight_shard: ``[V/tp, h]`` this rank's rows of the output-layer weight.
        chunk_size, all_reduce_hidden_grad: see :class:`~megatron_gkd.losses.fused.FusedOptions`.
        token_ids, advantages, tp_group, old_logprobs, behaviour_logprobs, temperature, real_vocab_size,
            **options: as for :func:`vocab_parallel_policy_gradient_loss`.

    Returns:
        As :func:`vocab_parallel_policy_gradient_loss`; the gradient flows to ``hidden`` and the weight shard.
    """
    built = PolicyGradientOptions.of(options)  # refuse a bad option before the forward's matmuls
    logprobs = fused_vocab_parallel_token_logprobs(
        hidden, output_weight_shard, token_ids, tp_group, temperature=temperature, real_vocab_size=real_vocab_size,
        chunk_size=chunk_size, all_reduce_hidden_grad=all_reduce_hidden_grad,
    )
    return policy_gradient_from_logprobs(logprobs, advantages, old_logprobs, behaviour_logprobs, built)
