"""Test cases for the vocab-parallel losses and a body that checks them on every rank.

Each case is a full-vocabulary problem built from a seed (the same on every rank); a rank slices its
shard, runs :func:`vocab_parallel_distill_loss`, back-propagates an upstream gradient (zero at masked
tokens) and compares value and gradient shard with :func:`reference_distill_loss` (float64, dense,
autograd) evaluated on the same (dtype-rounded) logits.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist

from megatron_gkd.losses import fused_vocab_parallel_distill_loss, vocab_parallel_distill_loss, vocab_parallel_topk
from megatron_gkd.losses.reference import reference_distill_loss
from megatron_gkd.testing.divergence_cases import divergence_cases

LOSS_CONFIGS: list[tuple[str, dict]] = divergence_cases()

# Relative tolerances: values and gradients against the float64 reference.
TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 1e-4}
# bf16 gradients are returned in bf16: one rounding of at most half an ulp (2^-9 relative) on top.
BF16_ROUNDING = 2.0**-8


@dataclasses.dataclass
class LossCase:
    """A full-vocabulary problem. ``logits`` ``[N, V]`` (or ``[s, b, V]``) fp64; teacher ``[..., K]``."""

    name: str
    logits: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    grad_out: torch.Tensor
    temperature: float = 1.0
    real_vocab_size: int | None = None  # columns from it on are padding rows of the table


def _teacher_topk(logits: torch.Tensor, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.randn(logits.shape, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(logits + 1.5 * noise, dim=-1)
    logprobs, ids = teacher.topk(k, dim=-1)
    return ids, logprobs.float()


def _teacher_at(logits: torch.Tensor, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(logits.shape, generator=generator, dtype=torch.float64)
    return torch.log_softmax(logits + 1.5 * noise, dim=-1).gather(-1, ids).float()


def _random_ids(num_rows: int, low: int, high: int, k: int, generator: torch.Generator) -> torch.Tensor:
    return torch.stack([low + torch.randperm(high - low, generator=generator)[:k] for _ in range(num_rows)])


def make_cases(tp_size: int, seed: int = 0) -> list[LossCase]:
    """The edge cases the acceptance names, sized so that every TP size in {1, 2, 4} divides V."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens, vocab, k = 24, 64, 8
    vocab_local = vocab // tp_size

    def logits(n: int = num_tokens, v: int = vocab) -> torch.Tensor:
        return 2.0 * torch.randn(n, v, generator=generator, dtype=torch.float64)

    def grad_out(n: int = num_tokens) -> torch.Tensor:
        return torch.randn(n, generator=generator, dtype=torch.float64)

    cases = []
    x = logits()
    ids, lp = _teacher_topk(x, k, generator)
    cases.append(LossCase("topk", x, ids, lp, grad_out()))
    cases.append(LossCase("temperature_0.5", x, ids, lp, grad_out(), temperature=0.5))
    cases.append(LossCase("temperature_2", x, ids, lp, grad_out(), temperature=2.0))

    # Several ids in one shard (the first): on rank 0 they are all local, elsewhere all remote.
    x = logits()
    ids = _random_ids(num_tokens, 0, vocab_local, min(k, vocab_local), generator)
    cases.append(LossCase("all_in_first_shard", x, ids, _teacher_at(x, ids, generator), grad_out()))
    ids = _random_ids(num_tokens, vocab - vocab_local, vocab, min(k, vocab_local), generator)
    cases.append(LossCase("all_in_last_shard", x, ids, _teacher_at(x, ids, generator), grad_out()))

    # Local index 0 of every shard together with ids of other shards (the scatter-into-slot-0 bug).
    starts = torch.arange(tp_size) * vocab_local
    others = _random_ids(num_tokens, 0, vocab, k + tp_size, generator)
    ids = torch.stack([torch.cat([starts, row[~torch.isin(row, starts)][: k]]) for row in others])
    cases.append(LossCase("local_index_zero", x, ids, _teacher_at(x, ids, generator), grad_out(),
                          temperature=0.7))

    # Padding: -inf tails, fully padded rows, padding ids that are 0, -1 or past the vocabulary.
    x = logits()
    ids, lp = _teacher_topk(x, k, generator)
    lp[1::3, k // 2:] = float("-inf")
    lp[2::5] = float("-inf")
    ids[1::3, -1] = 0
    ids[2::5] = -1
    ids[4::5, -2:] = vocab + 5
    lp[4::5, -2:] = float("-inf")
    cases.append(LossCase("padded", x, ids, lp, grad_out()))

    # Masked tokens: upstream gradient 0 and fully padded teacher rows there.
    ids, lp = _teacher_topk(x, k, generator)
    masked = torch.arange(num_tokens) % 4 == 3
    lp[masked] = float("-inf")
    upstream = grad_out()
    upstream[masked] = 0.0
    cases.append(LossCase("masked_tokens", x, ids, lp, upstream))

    # [s, b, V/tp] layout.
    x = logits().reshape(4, 6, vocab)
    ids, lp = _teacher_topk(x, k, generator)
    cases.append(LossCase("sbv_layout", x, ids, lp, grad_out().reshape(4, 6), temperature=1.3))

    # K = 256.
    x = logits(8, 1024)
    ids, lp = _teacher_topk(x, 256, generator)
    cases.append(LossCase("k256", x, ids, lp, grad_out(8)))

    # A table longer than the tokenizer (Qwen3: 151,669 tokens in 151,936 rows): the padding rows hold the
    # largest logits, so any mass or gradient left on them shows. The last shard is part padding, and at
    # TP > 1 a second case leaves the last shard nothing but padding.
    for name, real in padding_cases(vocab, tp_size):
        x = logits()
        x[:, real:] += 8.0
        ids, lp = _teacher_topk(x[:, :real], k, generator)
        cases.append(LossCase(name, x, ids, lp, grad_out(), temperature=0.9, real_vocab_size=real))
    return cases


def padding_cases(vocab: int, tp_size: int) -> list[tuple[str, int]]:
    """``(name, real_vocab_size)`` of the padded-table cases at this TP size."""
    found = [("padding_rows", vocab - 5)]
    if tp_size > 1:
        found.append(("padding_shard", vocab - vocab // tp_size - 3))
    return found


def shard(full: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    return full.chunk(tp_size, dim=-1)[rank].contiguous()


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual.double().cpu() - expected.cpu()).abs().max().item() / max(scale, 1e-30) if expected.numel() else 0.0


def _bf16_grad_error(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> float:
    """Largest ratio of the error to what one bf16 rounding plus ``tolerance`` allow (pass: <= 1)."""
    allowed = BF16_ROUNDING * expected.abs() + tolerance * max(expected.abs().max().item(), 1e-30)
    return ((actual.double() - expected).abs() / allowed).max().item()


def check_case(case: LossCase, loss_type: str, options: dict, dtype: torch.dtype,
               rank: int, tp_size: int, group, device: torch.device | str = "cpu") -> dict:
    """Runs one case on this rank's shard on ``device``; returns errors normalised so that <= 1 passes.

    The reference runs on the host in float64 whatever ``device`` is.
    """
    rounded = case.logits.to(dtype, copy=True)
    local = shard(rounded, rank, tp_size).to(device).requires_grad_()
    loss, metrics = vocab_parallel_distill_loss(
        local, case.ids.to(device), case.logprobs.to(device), loss_type=loss_type, tp_group=group,
        temperature=case.temperature, real_vocab_size=case.real_vocab_size, **options,
    )
    (loss.double() * case.grad_out.to(device)).sum().backward()
    loss, grad, metrics = loss.cpu(), local.grad.cpu(), {k: v.cpu() for k, v in metrics.items()}
    full = rounded.double().reshape(-1, rounded.shape[-1]).requires_grad_()
    expected = reference_distill_loss(
        full, case.ids.reshape(-1, case.ids.shape[-1]), case.logprobs.reshape(-1, case.ids.shape[-1]),
        loss_type, case.temperature, real_vocab_size=case.real_vocab_size, **options,
    )
    (expected * case.grad_out.reshape(-1)).sum().backward()
    expected_grad = shard(full.grad.reshape(rounded.shape), rank, tp_size)
    tolerance = TOLERANCES[dtype]
    if dtype == torch.bfloat16:
        grad_error = _bf16_grad_error(grad, expected_grad, tolerance)
    else:
        grad_error = _relative(grad, expected_grad) / tolerance
    return {
        "case": case.name, "loss_type": loss_type, "options": options, "dtype": str(dtype),
        "loss_error": _relative(loss.reshape(-1), expected.detach()) / tolerance,
        "grad_error": grad_error,
        "grad_dtype_ok": grad.dtype == dtype and loss.shape == case.grad_out.shape,
        "metrics_finite": all(bool(torch.isfinite(v).all()) for v in metrics.values()),
    }


def check_all_cases(dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.bfloat16),
                    device: torch.device | str = "cpu") -> list[dict]:
    """Body for ``run_distributed``: every case x loss config x dtype on the default group, on ``device``."""
    tp_size, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    return [
        check_case(case, loss_type, options, dtype, rank, tp_size, group, device)
        for case in make_cases(tp_size)
        for loss_type, options in LOSS_CONFIGS
        for dtype in dtypes
    ]


def failures(results: list[dict]) -> list[dict]:
    """The results whose error exceeds its tolerance or whose dtype/shape/metrics are wrong."""
    return [
        r for r in results
        if not (r["loss_error"] <= 1.0 and r["grad_error"] <= 1.0 and r["grad_dtype_ok"] and r["metrics_finite"])
    ]


def check_fused_against_unfused(chunk_size: int = 5, hidden_size: int = 16, device: torch.device | str = "cpu") -> dict:
    """Body for ``run_distributed``: fused vs unfused vs reference (fp32 and fp64), grads of hidden and W.

    The fused and unfused losses run on ``device``, the float64 reference on the host.
    """
    if dist.is_initialized():
        tp_size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    else:
        tp_size, rank, group = 1, 0, None
    generator = torch.Generator().manual_seed(1)
    num_tokens, vocab, k = 23, 64, 8
    hidden_full = torch.randn(num_tokens, hidden_size, generator=generator, dtype=torch.float64)
    weight_full = 0.5 * torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    ids, lp = _teacher_topk(hidden_full @ weight_full.t(), k, generator)
    lp[3] = float("-inf")
    upstream = torch.randn(num_tokens, generator=generator, dtype=torch.float64)
    teachers = {None: (ids, lp)}
    for _, real in padding_cases(vocab, tp_size):  # padded tables: teacher ids among the tokens only
        teachers[real] = _teacher_topk((hidden_full @ weight_full.t())[:, :real], k, generator)
    errors = {}
    for (real, (ids, lp)), (loss_type, options), dtype in itertools.product(
            teachers.items(), LOSS_CONFIGS, (torch.float64, torch.float32)):
        options = dict(options, real_vocab_size=real) if real is not None else options
        on_device = ids.to(device), lp.to(device), upstream.to(device)
        hidden = hidden_full.to(device, dtype, copy=True).requires_grad_()
        weight = shard(weight_full.to(dtype).t(), rank, tp_size).t().contiguous().to(device).requires_grad_()
        loss, _ = fused_vocab_parallel_distill_loss(
            hidden, weight, *on_device[:2], loss_type=loss_type, tp_group=group, temperature=0.8,
            chunk_size=chunk_size, **options,
        )
        (loss.double() * on_device[2]).sum().backward()
        hidden_u = hidden_full.to(device, dtype, copy=True).requires_grad_()
        weight_u = weight.detach().clone().requires_grad_()
        logits = hidden_u @ weight_u.t()
        loss_u, _ = vocab_parallel_distill_loss(
            logits, *on_device[:2], loss_type=loss_type, tp_group=group, temperature=0.8, **options
        )
        (loss_u.double() * on_device[2]).sum().backward()
        grad_hidden_u = hidden_u.grad.clone()
        if tp_size > 1:
            dist.all_reduce(grad_hidden_u, group=group)
        key = f"{loss_type}{options}/{dtype}"
        errors[key] = max(
            _relative(loss, loss_u.detach().double()),
            _relative(hidden.grad, grad_hidden_u.double()),
            _relative(weight.grad, weight_u.grad.double()),
        )
        if dtype == torch.float64:
            hidden_r = hidden_full.detach().clone().requires_grad_()
            weight_r = weight_full.detach().clone().requires_grad_()
            expected = reference_distill_loss(hidden_r @ weight_r.t(), ids, lp, loss_type, 0.8, **options)
            (expected * upstream).sum().backward()
            errors[key + "/reference"] = max(
                _relative(loss, expected.detach()),
                _relative(hidden.grad, hidden_r.grad),
                _relative(weight.grad, shard(weight_r.grad.t(), rank, tp_size).t()),
            )
    return errors


def check_topk(k: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """Body for ``run_distributed``: vocab-parallel top-k ids vs ``torch.topk`` of the full logits."""
    tp_size, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(2)
    full = torch.randn(6, 64, generator=generator)
    ids, values = vocab_parallel_topk(shard(full, rank, tp_size), k, dist.group.WORLD)
    expected_values, expected_ids = full.topk(k, dim=-1)
    assert torch.equal(values, expected_values)
    found, expected = ids.tolist(), expected_ids.tolist()
    # Padding rows holding the largest logits are never chosen, even from a shard of padding only.
    full[:, 40:] += 10.0
    for _, real in padding_cases(64, tp_size):
        ids, values = vocab_parallel_topk(shard(full, rank, tp_size), k, dist.group.WORLD, real_vocab_size=real)
        expected_values, expected_ids = full[:, :real].topk(k, dim=-1)
        assert torch.equal(values, expected_values), real
        found, expected = found + ids.tolist(), expected + expected_ids.tolist()
    return found, expected


def check_everything() -> dict:
    """Body for ``run_distributed`` doing all the checks above in one spawn (spawning is the slow part)."""
    return {
        "cases": check_all_cases(),
        "fused": check_fused_against_unfused(chunk_size=7),
        "topk": check_topk(),
    }
