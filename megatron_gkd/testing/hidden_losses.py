"""Test cases for the hidden-signal loss and a body that checks them on every rank (TP=1 or more).

Each case is a whole problem built from a seed (the same on every rank): student hidden states and
output table, teacher hidden states and output table (of its own size, padded or cut to the student's
rows as :func:`megatron_gkd.models.teacher_head.load_teacher_head` does), token weights with zeros.
A rank slices its vocabulary shard, runs :func:`hidden_distill_loss` fused (hidden states) and unfused
(the student's logit shard), back-propagates, and compares the loss and the gradients with the dense
float64 reference :func:`reference_full_vocab_loss` under autograd.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_gkd.losses import hidden_topk, vocab_parallel_distill_loss
from megatron_gkd.losses.hidden import hidden_distill_loss, hidden_token_logprobs
from megatron_gkd.losses.reference import reference_full_vocab_loss
from megatron_gkd.testing.divergence_cases import divergence_cases

LOSS_CONFIGS: list[tuple[str, dict]] = divergence_cases(lambda divergence: divergence.dense is not None)
TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-4}
# Nats between hidden_token_logprobs and the float64 reference, by the head's dtype. bf16: the matmul's bf16
# output rounds logits of |z| <= ~6 here by up to 2**-8 |z| (measured: 0.019 at most at TP=1).
TOKEN_LOGPROB_TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 0.05}


@dataclasses.dataclass
class HiddenCase:
    """A whole problem in float64; ``teacher_table`` already has the student's number of rows."""

    name: str
    student_hidden: torch.Tensor  # [N, h_s]
    student_table: torch.Tensor  # [V, h_s]
    teacher_hidden: torch.Tensor  # [N, h_t]
    teacher_table: torch.Tensor  # [V, h_t]
    weights: torch.Tensor  # [N]
    real_vocab_size: int
    temperature: float = 1.0
    teacher_temperature: float = 1.0


def _table_for_student(teacher_rows: int, student_rows: int, hidden: int, generator) -> torch.Tensor:
    """A teacher table of ``teacher_rows`` cut or zero-padded to the student's ``student_rows``."""
    table = torch.randn(teacher_rows, hidden, generator=generator, dtype=torch.float64) * 0.6
    out = torch.zeros(student_rows, hidden, dtype=torch.float64)
    rows = min(teacher_rows, student_rows)
    out[:rows] = table[:rows]
    return out


def make_cases(tp_size: int) -> list[HiddenCase]:
    """Cases whose vocabulary splits into ``tp_size`` shards: equal tables, padded and unequal tables,
    a shard of padding only, temperatures, all-zero weights."""
    generator = torch.Generator().manual_seed(1234)
    vocab = 12 * tp_size

    def case(name, *, teacher_rows=vocab, real=vocab, num_tokens=11, h_s=8, h_t=12, zeros=(2, 5), **temps):
        student_hidden = torch.randn(num_tokens, h_s, generator=generator, dtype=torch.float64)
        teacher_hidden = torch.randn(num_tokens, h_t, generator=generator, dtype=torch.float64)
        weights = torch.rand(num_tokens, generator=generator, dtype=torch.float64) + 0.1
        weights[list(zeros)] = 0.0
        student_table = torch.randn(vocab, h_s, generator=generator, dtype=torch.float64) * 0.6
        return HiddenCase(name, student_hidden, student_table, teacher_hidden,
                          _table_for_student(teacher_rows, vocab, h_t, generator), weights, real, **temps)

    cases = [
        case("equal"),
        case("temperatures", temperature=1.7, teacher_temperature=0.6),
        case("teacher_table_longer", teacher_rows=vocab + 5, real=vocab - 5),
        case("teacher_table_shorter", teacher_rows=vocab - 3, real=vocab - 7),
        case("one_token", num_tokens=1, zeros=()),
    ]
    if tp_size > 1:
        cases.append(case("padding_only_shard", real=12 * (tp_size - 1) - 1))
    return cases


def _shard(table: torch.Tensor, layout_rank: int, tp_size: int) -> torch.Tensor:
    rows = table.shape[0] // tp_size
    return table[layout_rank * rows:(layout_rank + 1) * rows]


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    return float((value.double().cpu() - reference.cpu()).abs().max()) / max(scale, 1e-30) if value.numel() else 0.0


def _reference(case: HiddenCase, loss_type: str, options: dict):
    """Dense float64 loss and gradients of ``sum w loss`` w.r.t. student hidden, table and logits."""
    hidden = case.student_hidden.clone().requires_grad_(True)
    table = case.student_table.clone().requires_grad_(True)
    logits = hidden @ table.t()
    logits.retain_grad()
    per_token = reference_full_vocab_loss(logits, case.teacher_hidden @ case.teacher_table.t(), loss_type,
                                          case.temperature, case.teacher_temperature, case.real_vocab_size, **options)
    total = (per_token * case.weights).sum()
    total.backward()
    return total.detach(), per_token.detach(), hidden.grad, table.grad, logits.grad


def check_case(case: HiddenCase, loss_type: str, options: dict, *, dtype: torch.dtype, tp_group,
               chunk_size: int, device: torch.device | str = "cpu") -> dict[str, float]:
    """Relative errors of the fused and unfused hidden paths on ``device`` against the (host) reference."""
    rank, tp_size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    total_ref, loss_ref, hidden_grad_ref, table_grad_ref, logits_grad_ref = _reference(case, loss_type, options)
    table_shard = _shard(case.student_table, rank, tp_size)
    teacher_shard = _shard(case.teacher_table, rank, tp_size).to(device, dtype)
    teacher_hidden, weights = case.teacher_hidden.to(device, dtype), case.weights.to(device)
    common = dict(loss_type=loss_type, tp_group=tp_group, temperature=case.temperature,
                  teacher_temperature=case.teacher_temperature, real_vocab_size=case.real_vocab_size,
                  chunk_size=chunk_size, **options)
    errors, counted = {}, case.weights != 0  # tokens of weight 0 are skipped: loss 0
    hidden = case.student_hidden.to(device, dtype, copy=True).requires_grad_(True)
    weight = table_shard.to(device, dtype, copy=True).requires_grad_(True)
    total, loss, _ = hidden_distill_loss(hidden, teacher_hidden, teacher_shard, weights,
                                         student_weight=weight, **common)
    total.backward()
    loss = loss.cpu()
    errors["fused_total"] = _relative(total.detach(), total_ref)
    errors["fused_loss"] = _relative(loss[counted], loss_ref[counted])
    errors["fused_hidden_grad"] = _relative(hidden.grad, hidden_grad_ref)
    errors["fused_weight_grad"] = _relative(weight.grad, _shard(table_grad_ref, rank, tp_size))
    logits = (case.student_hidden @ table_shard.t()).to(device, dtype, copy=True).requires_grad_(True)
    total, loss, _ = hidden_distill_loss(logits, teacher_hidden, teacher_shard, weights, **common)
    total.backward()
    loss = loss.cpu()
    errors["unfused_total"] = _relative(total.detach(), total_ref)
    errors["unfused_loss"] = _relative(loss[counted], loss_ref[counted])
    errors["skipped_tokens"] = float(loss[~counted].abs().max()) if (~counted).any() else 0.0
    errors["unfused_logits_grad"] = _relative(logits.grad, _shard(logits_grad_ref.t(), rank, tp_size).t())
    return errors


def check_topk_equivalence(case: HiddenCase, loss_type: str, options: dict, tp_group) -> float:
    """Relative difference between the hidden path and the top-k path at k = V (no padding), fp64."""
    rank, tp_size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    vocab = case.student_table.shape[0]
    teacher_logprobs = torch.log_softmax(case.teacher_hidden @ case.teacher_table.t() / case.teacher_temperature, -1)
    ids = torch.arange(vocab).expand(case.weights.numel(), vocab).contiguous()
    shard = _shard(case.student_table, rank, tp_size)
    logits = (case.student_hidden @ shard.t()).requires_grad_(True)
    per_token, _ = vocab_parallel_distill_loss(logits, ids, teacher_logprobs, loss_type=loss_type, tp_group=tp_group,
                                               temperature=case.temperature, **options)
    (per_token * case.weights).sum().backward()
    topk_grad = logits.grad
    logits = (case.student_hidden @ shard.t()).requires_grad_(True)
    total, hidden_loss, _ = hidden_distill_loss(logits, case.teacher_hidden, _shard(case.teacher_table, rank, tp_size),
                                                case.weights, loss_type=loss_type, tp_group=tp_group,
                                                temperature=case.temperature,
                                                teacher_temperature=case.teacher_temperature, **options)
    total.backward()
    masked = case.weights != 0
    return max(_relative(hidden_loss[masked], per_token.detach()[masked]), _relative(logits.grad, topk_grad))


def check_token_logprobs(case: HiddenCase, dtype: torch.dtype, tp_group, device: torch.device | str = "cpu") -> float:
    """Largest difference in nats between :func:`hidden_token_logprobs` on this rank's head shard (in ``dtype``) and
    the dense float64 log-prob of an id per token (every real id appears, the last one included)."""
    rank, tp_size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    real, num_tokens = case.real_vocab_size, case.weights.numel()
    ids = (torch.arange(num_tokens) * 7 + 3) % real
    ids[-1] = real - 1
    got = hidden_token_logprobs(case.teacher_hidden.to(device, dtype), _shard(case.teacher_table, rank, tp_size).to(
        device, dtype), ids.to(device), tp_group=tp_group, teacher_temperature=case.teacher_temperature,
        real_vocab_size=real)
    logits = case.teacher_hidden @ case.teacher_table[:real].t()
    reference = torch.log_softmax(logits / case.teacher_temperature, dim=-1).gather(1, ids[:, None])[:, 0]
    return float((got.double().cpu() - reference).abs().max())


def check_everything(tp_size: int | None = None, device: torch.device | str = "cpu") -> dict:
    """On every rank of the default group (its TP group): every case x loss x dtype x chunking on ``device``, the
    top-k equivalence at k = V (host), the teacher's token log-probs per case and head dtype, and its exact top-k
    (:func:`check_hidden_topk`). Returns ``{"cases": {key: errors}, "topk": {key: error}, "token_logprobs": {key:
    nats}, "hidden_topk": {...}}``."""
    tp_group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    tp_size = 1 if tp_group is None else dist.get_world_size()
    results: dict = {"cases": {}, "topk": {}, "token_logprobs": {}, "hidden_topk": check_hidden_topk()}
    for case in make_cases(tp_size):
        for dtype in TOKEN_LOGPROB_TOLERANCES:
            results["token_logprobs"][f"{case.name}/{dtype}"] = check_token_logprobs(case, dtype, tp_group, device)
        for loss_type, options in LOSS_CONFIGS:
            key = f"{case.name}/{loss_type}/{options}"
            for dtype in (torch.float64, torch.float32):
                for chunk_size in (3, 1024):
                    results["cases"][f"{key}/{dtype}/chunk{chunk_size}"] = check_case(
                        case, loss_type, options, dtype=dtype, tp_group=tp_group, chunk_size=chunk_size,
                        device=device)
            if case.real_vocab_size == case.student_table.shape[0]:
                results["topk"][key] = check_topk_equivalence(case, loss_type, options, tp_group)
    return results


def failures(results: dict) -> list[str]:
    """Keys whose errors exceed the dtype's tolerance."""
    bad = []
    for key, errors in results["cases"].items():
        tolerance = TOLERANCES[torch.float64 if "float64" in key else torch.float32]
        bad += [f"{key}: {name}={value:.3g}" for name, value in errors.items() if not value <= tolerance]
    bad += [f"topk {key}: {value:.3g}" for key, value in results["topk"].items() if not value <= 1e-9]
    bad += [f"token_logprobs {key}: {value:.3g} nats" for key, value in results["token_logprobs"].items()
            if not value <= TOKEN_LOGPROB_TOLERANCES[getattr(torch, key.rsplit(".", 1)[1])]]
    topk = results.get("hidden_topk")
    if topk is not None and not (topk["ids_equal"] and topk["logprob_error"] <= 1e-12):
        bad.append(f"hidden_topk: {topk}")
    return bad


def check_hidden_topk(seed: int = 0) -> dict:
    """On every rank of the default group: :func:`megatron_gkd.losses.hidden_topk` against the dense float64 top-k of
    ``log_softmax(hidden @ head^T / T)`` over the real rows (a padded, unequally split table; chunks of 3 rows).
    Returns ``{"ids_equal": bool, "logprob_error": float}``."""
    tp_group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    tp_size, rank = (1, 0) if tp_group is None else (dist.get_world_size(), dist.get_rank())
    generator = torch.Generator().manual_seed(seed)
    real, hidden_size, rows, k, temperature = 37, 8, 10, 5, 1.3
    padded = -(-real // tp_size) * tp_size + tp_size  # padding rows past the tokenizer, on the last rank(s)
    head = torch.randn(padded, hidden_size, generator=generator, dtype=torch.float64)
    head[real:] = 0.0
    hidden = 2.0 * torch.randn(rows, hidden_size, generator=generator, dtype=torch.float64)
    logprobs = torch.log_softmax(hidden @ head[:real].t() / temperature, dim=-1)
    expected_lp, expected_ids = logprobs.topk(k, dim=-1)
    local = head.chunk(tp_size)[rank]
    ids, got = hidden_topk(hidden, local, k, tp_group=tp_group, teacher_temperature=temperature, real_vocab_size=real,
                           chunk_size=3)
    return {"ids_equal": bool(torch.equal(ids, expected_ids)), "logprob_error": float((got - expected_lp).abs().max())}
