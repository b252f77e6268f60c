"""Dense float64 references of the distillation and policy-gradient losses: the full vocabulary, plain formulas,
autograd.

Written for clarity, not speed, and independently of the analytic gradients in
:mod:`megatron_gkd.losses.divergences` and :mod:`megatron_gkd.losses.token_logprobs`; tests and
``benchmarks/losses.py`` compare against them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _renormalise(log_values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Log of the distribution proportional to ``exp(log_values)`` on the valid entries (row has one)."""
    masked = log_values.masked_fill(~valid, float("-inf"))
    return masked - torch.logsumexp(masked, dim=-1, keepdim=True)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_valid a (log a - log b)``."""
    safe_a = torch.where(valid, log_a, torch.zeros_like(log_a))
    safe_b = torch.where(valid, log_b, torch.zeros_like(log_b))
    return (valid * safe_a.exp() * (safe_a - safe_b)).sum(-1)


def _jsd(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    p = torch.where(valid, log_p, torch.zeros_like(log_p)).exp() * valid
    q = torch.where(valid, log_q, torch.zeros_like(log_q)).exp() * valid
    mixture = torch.where(valid, beta * p + (1 - beta) * q, torch.ones_like(p))  # log(0) has a NaN grad
    log_m = torch.log(mixture)
    return beta * _kl(log_p, log_m, valid) + (1 - beta) * _kl(log_q, log_m, valid)


SupportReference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict], torch.Tensor]
_REFERENCES: dict[str, SupportReference] = {}


def reference_divergence(name: str) -> Callable[[SupportReference], SupportReference]:
    """Registers the float64 reference of the divergence registered as ``name``:
    ``fn(forward_kl, log_p_hat, log_q_hat, valid, options) -> [N]``, where ``forward_kl`` is ``sum P (log P - log Q)``
    on the compared ids with the teacher *not* renormalised, ``log_p_hat`` / ``log_q_hat`` both distributions
    renormalised on them (``-inf`` off ``valid``) and ``options`` the loss's keyword options as given (defaults are the
    reference's to apply). Every reference here (top-k, tail bucket, whole vocabulary, cross-tokenizer) reads it, and
    the tests that check each registered divergence against its reference find it by the name."""

    def decorate(fn: SupportReference) -> SupportReference:
        _REFERENCES[name] = fn
        return fn

    return decorate


def reference_names() -> list[str]:
    """The divergences with a registered reference, sorted."""
    return sorted(_REFERENCES)


@reference_divergence("forward_kl")
def _forward_kl(forward_kl, log_p_hat, log_q_hat, valid, options):
    return forward_kl


@reference_divergence("reverse_kl")
def _reverse_kl(forward_kl, log_p_hat, log_q_hat, valid, options):
    return _kl(log_q_hat, log_p_hat, valid)


@reference_divergence("jsd")
def _jsd_reference(forward_kl, log_p_hat, log_q_hat, valid, options):
    return _jsd(log_p_hat, log_q_hat, valid, options.get("beta", 0.5))


@reference_divergence("kl_rkl")
def _kl_rkl(forward_kl, log_p_hat, log_q_hat, valid, options):
    ratio = options.get("rkl_ratio", 0.1)
    return (1 - ratio) * forward_kl + ratio * _kl(log_q_hat, log_p_hat, valid)


def _support_divergence(loss_type: str, forward_kl, log_p_hat, log_q_hat, valid, options) -> torch.Tensor | None:
    """The registered reference of ``loss_type`` (:func:`reference_divergence`); None where it has none."""
    reference = _REFERENCES.get(loss_type)
    return None if reference is None else reference(forward_kl, log_p_hat, log_q_hat, valid, options)


def reference_distill_loss(
    full_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_type: str,
    temperature: float = 1.0,
    *,
    dtype: torch.dtype = torch.float64,
    real_vocab_size: int | None = None,
    **options,
) -> torch.Tensor:
    """Per-token loss ``[N]`` from the full ``[N, V]`` logits, differentiable by autograd.

    Same definitions as :func:`megatron_gkd.losses.vocab_parallel_distill_loss`; rows whose teacher
    entries are all ``-inf`` get loss 0; columns at or past ``real_vocab_size`` (padding rows) are dropped
    from the student's softmax. ``dtype`` is float64 for tests; the benchmark's naive baseline passes float32.
    """
    logits = full_logits.to(dtype)[:, :real_vocab_size]
    lp = teacher_logprobs.to(dtype)
    valid = torch.isfinite(lp)
    has = valid.any(-1)
    loss = torch.zeros(logits.shape[0], dtype=dtype, device=logits.device)
    if not bool(has.any()):
        return loss + 0 * logits.sum()
    all_rows = bool(has.all())
    rows = has.nonzero().squeeze(1)
    ids = teacher_ids.long().clamp(0, logits.shape[1] - 1)  # padding ids may be anything
    if not all_rows:  # rows without support stay 0
        logits, lp, valid, ids = logits[rows], lp[rows], valid[rows], ids[rows]
    z = logits / temperature
    log_q_full = torch.log_softmax(z, dim=-1)
    log_q = log_q_full.gather(1, ids)
    z_support = z.gather(1, ids)
    forward_kl = _kl(lp, log_q, valid)  # teacher not renormalised
    log_p_hat, log_q_hat = _renormalise(lp, valid), _renormalise(z_support, valid)
    value = _support_divergence(loss_type, forward_kl, log_p_hat, log_q_hat, valid, options)
    if value is None and loss_type == "tcad":
        divergence = options.get("divergence", "forward_kl")
        if divergence == "forward_kl":
            value = _kl(log_p_hat, log_q_hat, valid)
        elif divergence == "reverse_kl":
            value = _kl(log_q_hat, log_p_hat, valid)
        else:
            value = _jsd(log_p_hat, log_q_hat, valid, options.get("alpha", 0.5))
        coverage = torch.logsumexp(z, -1) - torch.logsumexp(z_support.masked_fill(~valid, float("-inf")), -1)
        value = value + options.get("coverage_coef", 1.0) * coverage
    elif value is None:
        raise ValueError(f"no reference for loss_type {loss_type!r}")
    return value if all_rows else loss.index_put((rows,), value)


def reference_tail_distill_loss(
    full_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_type: str,
    temperature: float = 1.0,
    *,
    real_vocab_size: int | None = None,
    tail_floor: float = 1e-6,
    **options,
) -> torch.Tensor:
    """Per-token loss ``[N]`` (float64, autograd) with the tail bucket: the divergences of
    :func:`reference_distill_loss` between two distributions over ``k+1`` outcomes, the teacher's ids and "any other
    token". The teacher's tail is ``max(1 - sum p, tail_floor)``; the student's the sum of its softmax over the real
    vocabulary's ids outside the teacher's (no outcome, left out, when there are none). Rows without a valid teacher
    entry get 0."""
    logits = full_logits.double()[:, :real_vocab_size]
    lp = teacher_logprobs.double()
    valid = torch.isfinite(lp)
    has = valid.any(-1)
    loss = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    if not bool(has.any()):
        return loss + 0 * logits.sum()
    if loss_type == "tcad":
        raise ValueError("tcad has no tail-bucket form")
    rows = has.nonzero().squeeze(1)
    lp, valid = lp[rows], valid[rows]
    ids = teacher_ids.long()[rows].clamp(0, logits.shape[1] - 1)  # padding ids may be anything
    log_q_full = torch.log_softmax(logits[rows] / temperature, dim=-1)
    in_top = torch.zeros(log_q_full.shape, dtype=torch.bool, device=logits.device)
    in_top[torch.arange(len(rows)).unsqueeze(1).expand_as(ids)[valid], ids[valid]] = True
    student_tail = (log_q_full.exp() * ~in_top).sum(-1)
    has_tail = (~in_top).any(-1)
    teacher_tail = (1 - (lp.exp() * valid).sum(-1)).clamp(min=tail_floor)
    log_q = torch.cat([log_q_full.gather(1, ids), torch.where(has_tail, student_tail, 1.0).log()[:, None]], 1)
    log_p = torch.cat([lp, teacher_tail.log()[:, None]], 1)
    bucket = torch.cat([valid, has_tail[:, None]], 1)
    log_p, log_q = log_p.masked_fill(~bucket, float("-inf")), log_q.masked_fill(~bucket, float("-inf"))
    forward_kl = _kl(log_p, log_q, bucket)
    value = _support_divergence(loss_type, forward_kl, _renormalise(log_p, bucket), _renormalise(log_q, bucket),
                                bucket, options)
    if value is None:
        raise ValueError(f"no reference for loss_type {loss_type!r}")
    return loss.index_put((rows,), value)


def reference_full_vocab_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_type: str,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    real_vocab_size: int | None = None,
    **options,
) -> torch.Tensor:
    """Per-token full-vocabulary divergence ``[N]`` from both models' whole ``[N, V]`` logits (float64).

    Ids at or past ``real_vocab_size`` are dropped on both sides. Same definitions as
    :func:`megatron_gkd.losses.hidden.hidden_distill_loss` (``tcad``: its ``divergence`` on the whole
    vocabulary, where the coverage term vanishes).
    """
    real = student_logits.shape[-1] if real_vocab_size is None else real_vocab_size
    log_q = torch.log_softmax(student_logits[:, :real].double() / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits[:, :real].double() / teacher_temperature, dim=-1)
    valid = torch.ones_like(log_p, dtype=torch.bool)
    if loss_type == "tcad":
        loss_type, options = options.get("divergence", "forward_kl"), {"beta": options.get("alpha", 0.5)}
    value = _support_divergence(loss_type, _kl(log_p, log_q, valid), log_p, log_q, valid, options)  # nothing to renormalise
    if value is None:
        raise ValueError(f"no reference for loss_type {loss_type!r}")
    return value


def reference_token_logprobs(
    full_logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, real_vocab_size: int | None = None
) -> torch.Tensor:
    """``[N]`` float64 ``log_softmax(logits / T)[y]`` over the real vocabulary, from the full ``[N, V]`` logits."""
    log_q = torch.log_softmax(full_logits.double()[:, :real_vocab_size] / temperature, dim=-1)
    return log_q.gather(1, token_ids.long()[:, None])[:, 0]


def reference_policy_gradient_loss(
    full_logits: torch.Tensor,
    token_ids: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    real_vocab_size: int | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    tis_cap: float | None = None,
) -> torch.Tensor:
    """Per-token policy-gradient loss ``[N]`` (float64, autograd) with the definitions of
    :mod:`megatron_gkd.losses.policy_gradient`, written case by case on the advantage's sign as PPO's paper
    reads (``A >= 0``: the ratio is capped above; ``A < 0``: below, and at ``clip_ratio_c`` above)."""
    logp = reference_token_logprobs(full_logits, token_ids, temperature, real_vocab_size)
    old = logp.detach() if old_logprobs is None else old_logprobs.double()
    ratio = torch.exp(logp - old)
    advantages = advantages.double()
    upper = torch.minimum(ratio, torch.full_like(ratio, 1.0 + clip_high))
    lower = torch.maximum(ratio, torch.full_like(ratio, 1.0 - clip_low))
    if clip_ratio_c is not None:
        lower = torch.minimum(lower, torch.full_like(ratio, clip_ratio_c))
    objective = torch.where(advantages >= 0, advantages * upper, advantages * lower)
    if tis_cap is not None:
        objective = objective * torch.clamp(torch.exp(old - behaviour_logprobs.double()), max=tis_cap)
    return -objective


def reference_cross_vocab_loss(
    full_logits: torch.Tensor,
    projection: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_type: str,
    temperature: float = 1.0,
    *,
    real_vocab_size: int | None = None,
    **options,
) -> torch.Tensor:
    """Per-token cross-tokenizer loss ``[N]`` (float64, autograd) from the full ``[N, V_s]`` student logits and a
    dense ``[V_s, V_t]`` map: ``q = softmax(logits / T) @ W`` over the real student vocabulary, then the
    same-tokenizer definitions with ``q`` at the teacher's ids (:mod:`megatron_gkd.losses.cross_vocab.loss`). Teacher ids
    whose column of ``W`` is empty are left out like padding; rows with nothing to compare get 0."""
    logits = full_logits.double()[:, :real_vocab_size]
    weights = projection.double()[: logits.shape[1]]
    lp = teacher_logprobs.double()
    ids = teacher_ids.long().clamp(0, weights.shape[1] - 1)  # padding ids may be anything
    valid = torch.isfinite(lp) & (weights.sum(0) > 0)[ids]
    has = valid.any(-1)
    loss = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    if not bool(has.any()):
        return loss + 0 * logits.sum()
    rows = has.nonzero().squeeze(1)
    q = torch.softmax(logits[rows] / temperature, dim=-1) @ weights  # [n, V_t]
    lp, valid, ids = lp[rows], valid[rows], ids[rows]
    log_q = torch.log(torch.where(valid, q.gather(1, ids), torch.ones_like(lp)))  # log(0) has a NaN grad
    forward_kl = _kl(lp, log_q, valid)  # teacher not renormalised, q normalised over the student vocabulary
    log_p_hat, log_q_hat = _renormalise(lp, valid), _renormalise(log_q, valid)
    value = _support_divergence(loss_type, forward_kl, log_p_hat, log_q_hat, valid, options)
    if value is None:
        raise ValueError(f"no cross-tokenizer reference for loss_type {loss_type!r}")
    return loss.index_put((rows,), value)
