"""Test cases for the policy-gradient term and a body that checks them on every rank (TP=1 or more).

Each case is a whole problem built from a seed (the same on every rank): hidden states and an output table whose
product are the logits, sampled tokens, advantages of both signs, old and behaviour log-probs spread so that the
ratio lands inside, below and above the clip range, and an upstream gradient with zeros (tokens outside the loss).
A rank slices its vocabulary shard, runs the term unfused (on the logit shard) and fused (on hidden states and the
weight shard), back-propagates, and compares the loss and gradients with the dense float64 reference
(:func:`~megatron_gkd.losses.reference.reference_policy_gradient_loss`) under autograd, and with TP=1 (the same
function on the whole vocabulary). Errors are relative to the reference's largest value and divided by the dtype's
tolerance, so a record passes at ``<= 1``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_gkd.losses.policy_gradient import (
    fused_vocab_parallel_policy_gradient_loss,
    vocab_parallel_policy_gradient_loss,
)
from megatron_gkd.losses.reference import reference_policy_gradient_loss, reference_token_logprobs
from megatron_gkd.losses.sampled_kl import rollout_mismatch

# Relative tolerances against the float64 reference (measured errors are reported by the tests).
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-5}
# bf16 logit gradients come back in bf16: one rounding of at most half an ulp (2^-9 relative) on top.
BF16_ROUNDING = 2.0**-8
UNFUSED_DTYPES = (torch.float64, torch.float32, torch.bfloat16)
FUSED_DTYPES = (torch.float64, torch.float32)


@dataclasses.dataclass
class PGCase:
    """A whole problem in float64; the logits are ``hidden @ table^T``, tokens shaped like ``hidden[..., 0]``."""

    name: str
    hidden: torch.Tensor  # [N, h] or [s, b, h]
    table: torch.Tensor  # [V, h]
    token_ids: torch.Tensor  # [N] or [s, b]
    advantages: torch.Tensor
    grad_out: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    temperature: float = 1.0
    real_vocab_size: int | None = None
    options: dict = dataclasses.field(default_factory=dict)


def make_cases(tp_size: int, seed: int = 0) -> list[PGCase]:
    """Cases whose vocabulary (64 rows) splits into ``tp_size`` shards: on-policy, every clip regime with and
    without the dual clip, importance-sampling caps, padding rows (and at TP > 1 a shard of padding only),
    tokens all in one shard, the ``[s, b]`` layout."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens, hidden_size, vocab = 24, 16, 64

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def case(name, *, real=None, old_spread=None, behaviour_spread=None, token_range=None, lead=(num_tokens,),
             temperature=1.0, **options) -> PGCase:
        hidden, table = randn(*lead, hidden_size), 0.5 * randn(vocab, hidden_size)
        # Padding rows with 3x the norm: their largest logits lead most rows, so mass or gradient there would show.
        table[vocab if real is None else real:] *= 3.0
        logits = (hidden @ table.t()).reshape(-1, vocab)
        tokens = real or vocab
        low, high = token_range or (0, tokens)
        probs = torch.softmax(logits[:, low:high] / temperature, dim=-1)
        ids = low + torch.multinomial(probs, 1, generator=generator)[:, 0]
        logp = reference_token_logprobs(logits, ids, temperature, real)

        def spread(base, width):  # ratios up to exp(+-width): inside, below and above the clip range
            if width is None:
                return None
            noise = 2 * torch.rand(base.shape, generator=generator, dtype=torch.float64) - 1
            return (base + width * noise).clamp(max=0)

        old = spread(logp, old_spread)
        behaviour = spread(logp if old is None else old, behaviour_spread)
        advantages = randn(logp.numel())
        advantages[::7] = 0.0  # a group of equal rewards
        upstream = torch.rand(logp.numel(), generator=generator, dtype=torch.float64) + 0.5
        upstream[3::5] = 0.0  # tokens outside the loss (prompt or padding positions)

        def shaped(value):
            return None if value is None else value.reshape(lead)

        return PGCase(name, hidden, table, ids.reshape(lead), shaped(advantages), shaped(upstream), shaped(old),
                      shaped(behaviour), temperature, real, options)

    vocab_local = vocab // tp_size
    cases = [
        case("on_policy"),
        case("clip_regimes", old_spread=1.2, clip_low=0.2, clip_high=0.28),
        case("dual_clip", old_spread=1.5, clip_low=0.2, clip_high=0.28, clip_ratio_c=2.0),
        case("tis_cap", old_spread=0.6, behaviour_spread=1.5, tis_cap=1.5, temperature=0.7),
        case("tis_on_policy", behaviour_spread=1.0, tis_cap=2.0, clip_ratio_c=3.0),
        case("tokens_in_first_shard", old_spread=0.5, token_range=(0, vocab_local)),
        case("tokens_in_last_shard", old_spread=0.5, token_range=(vocab - vocab_local, vocab)),
        case("sb_layout", old_spread=0.8, lead=(4, 6), temperature=1.3, clip_high=0.3),
        case("padding_rows", real=vocab - 5, old_spread=1.0, behaviour_spread=0.5, tis_cap=1.2, temperature=0.9),
    ]
    if tp_size > 1:
        cases.append(case("padding_shard", real=vocab - vocab_local - 3, old_spread=1.0, temperature=0.9))
    return cases


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error over the largest reference value (0 for empty tensors)."""
    if not expected.numel():
        return 0.0
    scale = expected.abs().max().item()
    return (actual.double().cpu() - expected.double().cpu()).abs().max().item() / max(scale, 1e-30)


def _grad_error(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, roundings: int = 1) -> float:
    """Error over what the dtype allows (pass: <= 1); bf16 gradients may carry ``roundings`` bf16 roundings on top
    (2 when both sides were rounded to bf16, as TP=2 against TP=1)."""
    tolerance = TOLERANCES[dtype]
    if dtype != torch.bfloat16:
        return relative(actual, expected) / tolerance
    allowed = roundings * BF16_ROUNDING * expected.abs() + tolerance * max(expected.abs().max().item(), 1e-30)
    return ((actual.double().cpu() - expected).abs() / allowed).max().item()


def _inputs(case: PGCase, device) -> dict:
    """The term's keyword arguments besides the tokens and advantages, on ``device``."""
    def put(value):
        return None if value is None else value.to(device)

    return dict(old_logprobs=put(case.old_logprobs), behaviour_logprobs=put(case.behaviour_logprobs),
                temperature=case.temperature, real_vocab_size=case.real_vocab_size, **case.options)


def _reference_backward(case: PGCase, logits: torch.Tensor) -> torch.Tensor:
    """The float64 reference loss ``[N]`` on ``[N, V]`` logits, after back-propagating ``sum(grad_out x loss)``."""
    def flat(value):
        return None if value is None else value.reshape(-1)

    loss = reference_policy_gradient_loss(
        logits, flat(case.token_ids), flat(case.advantages), flat(case.old_logprobs), flat(case.behaviour_logprobs),
        temperature=case.temperature, real_vocab_size=case.real_vocab_size, **case.options,
    )
    (loss * flat(case.grad_out)).sum().backward()
    return loss.detach()


def _rank(tp_group) -> tuple[int, int]:
    return (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))


def _first_padding_column(case: PGCase, rank: int, vocab_local: int) -> int:
    """The first column of this rank's shard that is a padding row (its width when none is)."""
    real = case.real_vocab_size or case.table.shape[0]
    return min(vocab_local, max(0, real - rank * vocab_local))


def check_unfused(case: PGCase, dtype: torch.dtype, tp_group, device="cpu") -> dict:
    """The unfused term on this rank's logit shard (logits rounded to ``dtype``) against the reference and TP=1."""
    rank, tp_size = _rank(tp_group)
    rounded = (case.hidden @ case.table.t()).to(dtype)  # [..., V]: what the output layer would give
    logits_ref = rounded.to(torch.float64, copy=True).reshape(-1, rounded.shape[-1]).requires_grad_()
    loss_ref = _reference_backward(case, logits_ref)
    results = {}
    for name, group, parts, part in (("tp", tp_group, tp_size, rank), ("tp1", None, 1, 0)):
        local = rounded.to(device, copy=True).chunk(parts, dim=-1)[part].clone().requires_grad_()
        loss, metrics = vocab_parallel_policy_gradient_loss(local, case.token_ids.to(device),
                                                            case.advantages.to(device), tp_group=group,
                                                            **_inputs(case, device))
        (loss.double() * case.grad_out.to(device)).sum().backward()
        results[name] = (loss.detach().cpu(), local.grad.cpu(), metrics)
    loss, grad, metrics = results["tp"]
    expected_grad = logits_ref.grad.reshape(rounded.shape).chunk(tp_size, dim=-1)[rank]
    tp1_grad = results["tp1"][1].chunk(tp_size, dim=-1)[rank]
    tolerance = TOLERANCES[dtype]
    padding = _first_padding_column(case, rank, grad.shape[-1])
    return {
        "case": case.name, "path": "unfused", "dtype": str(dtype),
        "loss_error": relative(loss.reshape(-1), loss_ref) / tolerance,
        "grad_error": _grad_error(grad, expected_grad, dtype),
        "tp1_loss_error": relative(loss, results["tp1"][0]) / tolerance,
        "tp1_grad_error": _grad_error(grad, tp1_grad.double(), dtype, roundings=2),
        "padding_grad_zero": bool((grad[..., padding:] == 0).all()),
        "shapes_ok": loss.shape == case.token_ids.shape and grad.dtype == dtype
        and all(value.shape == case.token_ids.shape for value in metrics.values()),
    }


def check_fused(case: PGCase, dtype: torch.dtype, tp_group, chunk_size: int = 5, device="cpu") -> dict:
    """The fused term (hidden states and this rank's weight rows in ``dtype``) against the reference and TP=1."""
    rank, tp_size = _rank(tp_group)
    hidden_ref = case.hidden.to(dtype).to(torch.float64, copy=True).requires_grad_()
    table_ref = case.table.to(dtype).to(torch.float64, copy=True).requires_grad_()
    loss_ref = _reference_backward(case, hidden_ref.reshape(-1, hidden_ref.shape[-1]) @ table_ref.t())
    results = {}
    for name, group, parts, part in (("tp", tp_group, tp_size, rank), ("tp1", None, 1, 0)):
        hidden = case.hidden.to(device, dtype, copy=True).requires_grad_()
        weight = case.table.to(device, dtype, copy=True).chunk(parts, dim=0)[part].clone().requires_grad_()
        loss, _ = fused_vocab_parallel_policy_gradient_loss(
            hidden, weight, case.token_ids.to(device), case.advantages.to(device), tp_group=group,
            chunk_size=chunk_size, **_inputs(case, device),
        )
        (loss.double() * case.grad_out.to(device)).sum().backward()
        results[name] = (loss.detach().cpu(), hidden.grad.cpu(), weight.grad.cpu())
    loss, grad_hidden, grad_weight = results["tp"]
    expected_weight = table_ref.grad.chunk(tp_size, dim=0)[rank]
    tp1_weight = results["tp1"][2].chunk(tp_size, dim=0)[rank]
    tolerance = TOLERANCES[dtype]
    padding = _first_padding_column(case, rank, grad_weight.shape[0])
    return {
        "case": case.name, "path": "fused", "dtype": str(dtype),
        "loss_error": relative(loss.reshape(-1), loss_ref) / tolerance,
        "grad_error": max(relative(grad_hidden, hidden_ref.grad), relative(grad_weight, expected_weight)) / tolerance,
        "tp1_loss_error": relative(loss, results["tp1"][0]) / tolerance,
        "tp1_grad_error": max(relative(grad_hidden, results["tp1"][1]), relative(grad_weight, tp1_weight)) / tolerance,
        "padding_grad_zero": bool((grad_weight[padding:] == 0).all()),
        "shapes_ok": loss.shape == case.token_ids.shape and grad_weight.dtype == dtype,
    }


def check_mismatch(tp_group) -> dict:
    """:func:`rollout_mismatch` pooled over ``tp_group`` (each rank its own tokens) against the pooled tokens."""
    rank, size = _rank(tp_group)
    per_rank = []
    for source in range(size):  # every rank's tokens, rebuilt from their seeds
        generator = torch.Generator().manual_seed(100 + source)
        train = -3 * torch.rand(5 + source, generator=generator, dtype=torch.float64)
        behaviour = train + 0.4 * torch.randn(train.shape, generator=generator, dtype=torch.float64)
        per_rank.append((train, behaviour, torch.arange(train.numel()) % 4 != 1))
    found = rollout_mismatch(*per_rank[rank], group=tp_group)
    train, behaviour, mask = (torch.cat(parts) for parts in zip(*per_rank))
    log_ratio = (train - behaviour)[mask]
    expected = {"kl_k1": (-log_ratio).mean(), "kl_k3": (log_ratio.exp() - 1 - log_ratio).mean(),
                "max_ratio": log_ratio.exp().max(), "min_ratio": log_ratio.exp().min(),
                "num_tokens": torch.tensor(float(log_ratio.numel()), dtype=torch.float64)}
    return {key: abs(found[key].item() - value.item()) for key, value in expected.items()}


def check_everything(device="cpu") -> dict:
    """Body for ``run_distributed`` (or TP=1 without a process group): every case, path and dtype, and the
    pooled mismatch metrics."""
    group = dist.group.WORLD if dist.is_initialized() else None
    cases = make_cases(_rank(group)[1])
    records = [check_unfused(case, dtype, group, device) for case in cases for dtype in UNFUSED_DTYPES]
    records += [check_fused(case, dtype, group, device=device) for case in cases for dtype in FUSED_DTYPES]
    return {"records": records, "mismatch": check_mismatch(group)}


def failures(records: list[dict]) -> list[dict]:
    """The records over their tolerance, with gradient on a padding row, or with a wrong shape or dtype."""
    errors = ("loss_error", "grad_error", "tp1_loss_error", "tp1_grad_error")
    return [r for r in records
            if not (all(r[key] <= 1.0 for key in errors) and r["padding_grad_zero"] and r["shapes_ok"])]
