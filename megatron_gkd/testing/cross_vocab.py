"""Maps and cases for the cross-tokenizer loss's tests and benchmark (megatron_gkd.losses.cross_vocab.loss).

A map here is the map builder's data contract: COO ``student_ids``, ``teacher_ids``, ``weights`` (a mapped student
token's row sums to 1), the two vocabulary sizes and ``exact`` (student tokens with a one-token teacher match).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd.losses.cross_vocab import heavy as cross_vocab_heavy
from megatron_gkd.losses.cross_vocab.fused import fused_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.hidden import hidden_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.loss import cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.projection_map import shard_projection
from megatron_gkd.losses.reference import reference_cross_vocab_loss
from megatron_gkd.testing.divergence_cases import divergence_cases

LOSS_CONFIGS: list[tuple[str, dict]] = divergence_cases(lambda divergence: divergence.cross_tokenizer)


@dataclasses.dataclass(frozen=True)
class VocabMap:
    student_ids: np.ndarray
    teacher_ids: np.ndarray
    weights: np.ndarray
    student_vocab_size: int
    teacher_vocab_size: int
    exact: np.ndarray

    def shard(self, tp_rank: int, tp_size: int, vocab_size_local: int, method: str = "projected",
              device: torch.device | str = "cpu"):
        return shard_projection(
            self.student_ids, self.teacher_ids, self.weights, student_vocab_size=self.student_vocab_size,
            teacher_vocab_size=self.teacher_vocab_size, exact=self.exact, tp_rank=tp_rank, tp_size=tp_size,
            vocab_size_local=vocab_size_local, method=method, device=device,
        )

    def dense(self, num_rows: int | None = None) -> torch.Tensor:
        """``[num_rows or V_s, V_t]`` float64 ``W`` (the float32 weights, exactly)."""
        out = torch.zeros(num_rows or self.student_vocab_size, self.teacher_vocab_size, dtype=torch.float64)
        out.index_put_((torch.from_numpy(self.student_ids), torch.from_numpy(self.teacher_ids)),
                       torch.from_numpy(self.weights.astype(np.float64)), accumulate=True)
        return out

    def dense_hybrid(self, num_rows: int | None = None) -> torch.Tensor:
        """H-KL's ``W``, written from its definition: a teacher id that is some exact student token's match keeps
        only the exact student tokens' entries."""
        out = self.dense(num_rows)
        exact_rows = torch.from_numpy(np.flatnonzero(self.exact))
        partners = out[exact_rows].argmax(1)
        keep = torch.zeros(out.shape[0], dtype=torch.bool)
        keep[exact_rows] = True
        for teacher_id in partners.tolist():
            out[~keep, teacher_id] = 0.0
        return out


def identity_map(vocab_size: int) -> VocabMap:
    ids = np.arange(vocab_size, dtype=np.int64)
    return VocabMap(ids, ids.copy(), np.ones(vocab_size, dtype=np.float32), vocab_size, vocab_size,
                    np.ones(vocab_size, dtype=bool))


def random_map(student_vocab_size: int, teacher_vocab_size: int, rng: np.random.Generator, *,
               multi_fraction: float = 0.25, unmapped_fraction: float = 0.05, max_pieces: int = 3,
               skew: float = 0.0, exact_fraction: float = 0.8) -> VocabMap:
    """Most student tokens one teacher token (exact), ``multi_fraction`` of them 2..``max_pieces`` pieces with
    decaying weights, ``unmapped_fraction`` none; ``exact_fraction`` of the one-piece tokens are exact matches.
    ``skew`` > 0 draws the pieces from a Zipf-like law over the teacher vocabulary (real maps: the first pieces of
    split words are common teacher tokens with a large fan-in)."""
    kind = rng.random(student_vocab_size)
    unmapped = kind < unmapped_fraction
    multi = ~unmapped & (kind < unmapped_fraction + multi_fraction)
    single = ~unmapped & ~multi
    students, teachers, weights = [], [], []
    single_rows = np.flatnonzero(single)
    students.append(single_rows)
    teachers.append(rng.integers(0, teacher_vocab_size, single_rows.size))
    weights.append(np.ones(single_rows.size, dtype=np.float32))
    multi_rows = np.flatnonzero(multi)
    pieces = rng.integers(2, max_pieces + 1, multi_rows.size)
    for count in range(2, max_pieces + 1):
        rows = multi_rows[pieces == count]
        if skew > 0:
            ranks = np.floor(teacher_vocab_size * rng.random((rows.size, count)) ** (1.0 + skew)).astype(np.int64)
            drawn = np.minimum(ranks, teacher_vocab_size - 1)  # low ids common, as a BPE vocabulary's first merges
        else:
            drawn = rng.integers(0, teacher_vocab_size, (rows.size, count))
        drawn = np.sort(drawn, axis=1)
        distinct = (np.diff(drawn, axis=1) != 0).all(1)  # a repeated piece: keep the row single-token instead
        rows, drawn = rows[distinct], drawn[distinct]
        decay = 0.5 ** np.arange(count)
        share = (decay / decay.sum()).astype(np.float32)
        share[-1] = np.float32(1.0) - share[:-1].sum(dtype=np.float32)
        students.append(np.repeat(rows, count))
        teachers.append(drawn.reshape(-1))
        weights.append(np.tile(share, rows.size))
    student_ids = np.concatenate(students).astype(np.int64)
    counts = np.bincount(student_ids, minlength=student_vocab_size)
    exact = (counts == 1) & (rng.random(student_vocab_size) < exact_fraction)  # 1:1 but not every one a string match
    missing = np.flatnonzero(multi & (counts == 0))  # multi rows dropped for a repeated piece: map them 1:1
    return VocabMap(
        np.concatenate([student_ids, missing]),
        np.concatenate([np.concatenate(teachers), rng.integers(0, teacher_vocab_size, missing.size)]).astype(np.int64),
        np.concatenate([np.concatenate(weights), np.ones(missing.size, dtype=np.float32)]),
        student_vocab_size, teacher_vocab_size, exact,
    )


@dataclasses.dataclass
class CrossCase:
    """A full-vocabulary problem: student ``logits`` ``[N, V]`` fp64 (``V`` >= the map's student vocabulary: the
    rest are padding rows), teacher top-k over the teacher vocabulary, an upstream gradient."""

    name: str
    vocab_map: VocabMap
    logits: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    grad_out: torch.Tensor
    temperature: float = 1.0
    real_vocab_size: int | None = None


def teacher_topk(num_rows: int, teacher_vocab_size: int, k: int, generator: torch.Generator):
    logits = 2.0 * torch.randn(num_rows, teacher_vocab_size, generator=generator, dtype=torch.float64)
    logprobs, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return ids, logprobs.float()


def make_cases(seed: int = 0) -> list[CrossCase]:
    """Edge cases at V_s = 48 (divisible by 1, 2, 4), V_t = 40, K = 8."""
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    num_rows, vocab, teacher_vocab, k = 16, 48, 40, 8

    def grad_out():
        return torch.randn(num_rows, generator=generator, dtype=torch.float64)

    def logits(v=vocab):
        return 2.0 * torch.randn(num_rows, v, generator=generator, dtype=torch.float64)

    cases = []
    vmap = random_map(vocab, teacher_vocab, rng)
    ids, lp = teacher_topk(num_rows, teacher_vocab, k, generator)
    cases.append(CrossCase("random_map", vmap, logits(), ids, lp, grad_out()))
    cases.append(CrossCase("temperature_0.7", vmap, logits(), ids, lp, grad_out(), temperature=0.7))
    # Teacher padding (-inf, any id) and fully padded rows.
    ids, lp = teacher_topk(num_rows, teacher_vocab, k, generator)
    lp[1::3, k // 2:] = float("-inf")
    ids[1::3, -1] = -1
    lp[2::5] = float("-inf")
    ids[4::5, -1] = teacher_vocab + 3
    lp[4::5, -1] = float("-inf")
    cases.append(CrossCase("teacher_padding", vmap, logits(), ids, lp, grad_out()))
    # Teacher ids that no student reaches (a quarter of the teacher vocabulary has no preimage).
    unreachable = rng.choice(teacher_vocab, teacher_vocab // 4, replace=False)
    cut = np.isin(vmap.teacher_ids, unreachable)
    rows_cut = np.unique(vmap.student_ids[cut])
    keep = ~np.isin(vmap.student_ids, rows_cut)
    sparse_map = VocabMap(vmap.student_ids[keep], vmap.teacher_ids[keep], vmap.weights[keep], vocab, teacher_vocab,
                          vmap.exact & ~np.isin(np.arange(vocab), rows_cut))
    ids, lp = teacher_topk(num_rows, teacher_vocab, k, generator)
    cases.append(CrossCase("unreachable_teacher_ids", sparse_map, logits(), ids, lp, grad_out()))
    # Every teacher id reached from both halves of the student vocabulary (a dropped TP reduction shows).
    half = vocab // 2
    student = np.arange(vocab)
    split = VocabMap(np.concatenate([student, student]), np.concatenate([student % half, (student + 7) % half]),
                     np.full(2 * vocab, 0.5, dtype=np.float32), vocab, teacher_vocab, np.zeros(vocab, dtype=bool))
    ids, lp = teacher_topk(num_rows, half, k, generator)
    cases.append(CrossCase("preimages_on_every_shard", split, logits(), ids, lp, grad_out(), temperature=1.3))
    # Padding rows of the student's output layer (the largest logits: any mass or gradient there shows); the
    # map covers the real vocabulary only.
    real = vocab - 13
    padded_map = random_map(real, teacher_vocab, rng)
    x = logits()
    x[:, real:] += 8.0
    ids, lp = teacher_topk(num_rows, teacher_vocab, k, generator)
    cases.append(CrossCase("student_padding_rows", padded_map, x, ids, lp, grad_out(), temperature=0.9,
                           real_vocab_size=real))
    return cases


def shard(full: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    return full.chunk(tp_size, dim=-1)[rank].contiguous()


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(expected.abs().max().item(), 1e-30)
    return (actual.double() - expected.double()).abs().max().item() / scale


def run_case(case: CrossCase, loss_type: str, options: dict, dtype: torch.dtype, method: str, rank: int,
             tp_size: int, group) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This rank's loss, gradient shard and metrics."""
    vocab = case.logits.shape[-1]
    local = shard(case.logits.to(dtype, copy=True), rank, tp_size).requires_grad_()
    projection = case.vocab_map.shard(rank, tp_size, vocab // tp_size, method)
    loss, metrics = cross_vocab_distill_loss(
        local, case.ids, case.logprobs, projection, loss_type=loss_type, tp_group=group,
        temperature=case.temperature, real_vocab_size=case.real_vocab_size, **options,
    )
    (loss.double() * case.grad_out).sum().backward()
    return loss.detach(), local.grad, metrics


def reference_case(case: CrossCase, loss_type: str, options: dict, dtype: torch.dtype,
                   method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 loss and full gradient on the dtype-rounded logits."""
    full = case.logits.to(dtype, copy=True).double().requires_grad_()
    weights = case.vocab_map.dense_hybrid() if method == "hybrid" else case.vocab_map.dense()
    loss = reference_cross_vocab_loss(full, weights, case.ids, case.logprobs, loss_type, case.temperature,
                                      real_vocab_size=case.real_vocab_size, **options)
    (loss * case.grad_out).sum().backward()
    return loss.detach(), full.grad


def check_tp(dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32)) -> list[dict]:
    """Body for ``run_distributed``: every case x loss x method x dtype at TP = world size against the dense
    reference and against TP=1 (the whole vocabulary in this process); errors relative to the reference's scale."""
    tp_size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    results = []
    for case in make_cases():
        for loss_type, options in LOSS_CONFIGS:
            for method in ("projected", "hybrid"):
                for dtype in dtypes:
                    loss, grad, metrics = run_case(case, loss_type, options, dtype, method, rank, tp_size, group)
                    single_loss, single_grad, _ = run_case(case, loss_type, options, dtype, method, 0, 1, None)
                    expected, expected_grad = reference_case(case, loss_type, options, dtype, method)
                    results.append({
                        "case": case.name, "loss_type": loss_type, "method": method, "dtype": str(dtype),
                        "loss_vs_reference": relative(loss, expected),
                        "grad_vs_reference": relative(grad, shard(expected_grad, rank, tp_size)),
                        "loss_vs_tp1": relative(loss, single_loss),
                        "grad_vs_tp1": relative(grad, shard(single_grad, rank, tp_size)),
                        "metrics_finite": all(bool(torch.isfinite(v).all()) for v in metrics.values()),
                    })
    return results


def check_fused_tp(dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32), hidden_size: int = 12) -> list[dict]:
    """Body for ``run_distributed``: the fused output layer + loss at TP = world size (token chunks of 5) against the
    dense float64 reference of ``hidden @ W^T``, gradients of the hidden states (summed over TP) and the weight rows."""
    tp_size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    generator = torch.Generator().manual_seed(7)
    results = []
    for case in make_cases():
        vocab = case.logits.shape[-1]
        hidden = torch.randn(case.logits.shape[0], hidden_size, generator=generator, dtype=torch.float64)
        weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
        for loss_type, options in LOSS_CONFIGS:
            for method in ("projected", "hybrid"):
                projection = case.vocab_map.shard(rank, tp_size, vocab // tp_size, method)
                full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                dense = case.vocab_map.dense_hybrid() if method == "hybrid" else case.vocab_map.dense()
                expected = reference_cross_vocab_loss(full_h @ full_w.t(), dense, case.ids, case.logprobs, loss_type,
                                                      case.temperature, real_vocab_size=case.real_vocab_size, **options)
                (expected * case.grad_out).sum().backward()
                for dtype in dtypes:
                    h = hidden.to(dtype, copy=True).requires_grad_()
                    w = shard(weight.t(), rank, tp_size).t().to(dtype, copy=True).requires_grad_()
                    loss, _ = fused_cross_vocab_distill_loss(
                        h, w, case.ids, case.logprobs, projection, loss_type=loss_type, tp_group=group,
                        temperature=case.temperature, real_vocab_size=case.real_vocab_size, chunk_size=5, **options)
                    (loss.double() * case.grad_out).sum().backward()
                    results.append({
                        "case": case.name, "loss_type": loss_type, "method": method, "dtype": str(dtype),
                        "loss": relative(loss.detach(), expected.detach()),
                        "grad_hidden": relative(h.grad, full_h.grad),
                        "grad_weight": relative(w.grad, shard(full_w.grad.t(), rank, tp_size).t()),
                    })
    return results


def reference_hidden_cross_vocab_loss(full_logits: torch.Tensor, projection: torch.Tensor, teacher_hidden: torch.Tensor,
                                      teacher_head: torch.Tensor, loss_type: str, temperature: float = 1.0,
                                      teacher_temperature: float = 1.0, *, real_vocab_size: int | None = None,
                                      teacher_real_vocab_size: int | None = None, **options) -> torch.Tensor:
    """Per-token loss ``[N]`` (float64, autograd) of megatron_gkd.losses.cross_vocab.hidden from its definition: the
    teacher's exact distribution ``softmax(hidden @ head^T / T_t)`` over its real vocabulary is a top-k row with
    ``K = V_t``, compared by :func:`reference_cross_vocab_loss` with the student projected through the dense ``W``."""
    teacher_logits = (teacher_hidden.double() @ teacher_head.double().t())[:, :teacher_real_vocab_size]
    logprobs = torch.log_softmax(teacher_logits / teacher_temperature, dim=-1)
    ids = torch.arange(logprobs.shape[1]).expand(logprobs.shape[0], -1)
    return reference_cross_vocab_loss(full_logits, projection[:, : logprobs.shape[1]], ids, logprobs, loss_type,
                                      temperature, real_vocab_size=real_vocab_size, **options)


@dataclasses.dataclass(frozen=True)
class HiddenCrossCase:
    """A cross-tokenizer case with the teacher's hidden states and head (megatron_gkd.losses.cross_vocab.hidden)."""

    vocab_map: VocabMap
    logits: torch.Tensor  # [N, V_s] float64, padding rows included
    teacher_hidden: torch.Tensor  # [N, h]
    teacher_head: torch.Tensor  # [V_t, h], padding rows included
    weights: torch.Tensor  # [N], zeros skip rows
    real_vocab_size: int | None = None
    teacher_real_vocab_size: int | None = None


def make_hidden_case(seed: int = 0, *, student_vocab: int = 24, teacher_vocab: int = 20, num_rows: int = 10,
                     hidden_size: int = 6, real_vocab_size: int | None = None,
                     teacher_real_vocab_size: int | None = None) -> HiddenCrossCase:
    generator = torch.Generator().manual_seed(seed)
    vocab_map = random_map(real_vocab_size or student_vocab, teacher_real_vocab_size or teacher_vocab,
                           np.random.default_rng(seed))
    weights = torch.rand(num_rows, generator=generator, dtype=torch.float64) + 0.5
    weights[1] = 0.0  # a skipped row
    return HiddenCrossCase(vocab_map, 2.0 * torch.randn(num_rows, student_vocab, generator=generator, dtype=torch.float64),
                           torch.randn(num_rows, hidden_size, generator=generator, dtype=torch.float64),
                           torch.randn(teacher_vocab, hidden_size, generator=generator, dtype=torch.float64),
                           weights, real_vocab_size, teacher_real_vocab_size)


def run_hidden_case(case: HiddenCrossCase, loss_type: str, options: dict, dtype: torch.dtype, rank: int,
                    tp_size: int, group, *, temperature: float = 0.8, teacher_temperature: float = 1.3,
                    chunk_size: int = 4):
    """This rank's ``(total, per_token, grad shard, metrics)`` of hidden_cross_vocab_distill_loss."""
    logits = shard(case.logits, rank, tp_size).to(dtype).requires_grad_()
    head = case.teacher_head.chunk(tp_size, dim=0)[rank].to(dtype)
    projection = case.vocab_map.shard(rank, tp_size, logits.shape[1])
    total, per_token, metrics = hidden_cross_vocab_distill_loss(
        logits, case.teacher_hidden.to(dtype), head, projection, case.weights.to(dtype), loss_type=loss_type,
        tp_group=group, temperature=temperature, teacher_temperature=teacher_temperature,
        real_vocab_size=case.real_vocab_size, teacher_real_vocab_size=case.teacher_real_vocab_size,
        chunk_size=chunk_size, **options)
    total.backward()
    return total.detach(), per_token, logits.grad, metrics


def reference_hidden_case(case: HiddenCrossCase, loss_type: str, options: dict, *, temperature: float = 0.8,
                          teacher_temperature: float = 1.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(total, per_token, grad [N, V_s])`` of the float64 reference."""
    logits = case.logits.clone().requires_grad_()
    per_token = reference_hidden_cross_vocab_loss(
        logits, case.vocab_map.dense(), case.teacher_hidden, case.teacher_head, loss_type, temperature,
        teacher_temperature, real_vocab_size=case.real_vocab_size,
        teacher_real_vocab_size=case.teacher_real_vocab_size, **options)
    total = (per_token * case.weights).sum()
    total.backward()
    return total.detach(), per_token.detach(), logits.grad


def check_hidden_tp(dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32)) -> list[dict]:
    """On each gloo rank: the hidden cross-tokenizer loss at this TP against the reference and TP=1."""
    rank, tp_size = dist.get_rank(), dist.get_world_size()
    results = []
    for name, kwargs in (("plain", {}), ("padding", {"real_vocab_size": 21, "teacher_real_vocab_size": 17})):
        case = make_hidden_case(3, **kwargs)
        for loss_type, options in LOSS_CONFIGS:
            expected, _, expected_grad = reference_hidden_case(case, loss_type, options)
            for dtype in dtypes:
                total, _, grad, _ = run_hidden_case(case, loss_type, options, dtype, rank, tp_size, dist.group.WORLD)
                single, _, single_grad, _ = run_hidden_case(case, loss_type, options, dtype, 0, 1, None)
                results.append({
                    "case": name, "loss_type": loss_type, "dtype": str(dtype),
                    "loss_vs_reference": relative(total, expected),
                    "grad_vs_reference": relative(grad, shard(expected_grad, rank, tp_size)),
                    "loss_vs_tp1": relative(total, single),
                    "grad_vs_tp1": relative(grad, shard(single_grad, rank, tp_size)),
                })
    return results


def heavy_map(student_vocab_size: int, teacher_vocab_size: int, num_heavy: int, rng: np.random.Generator) -> VocabMap:
    """Teacher ids ``[0, num_heavy)`` reached from most student tokens (each of those splits into a light piece and
    one of them), the other ids from one or two: the shape megatron_gkd.losses.cross_vocab.heavy projects densely."""
    students = np.arange(student_vocab_size)
    light = num_heavy + rng.integers(0, teacher_vocab_size - num_heavy, student_vocab_size)
    split = rng.random(student_vocab_size) < 0.75
    rows, cols, weights = [students[~split]], [light[~split]], [np.ones((~split).sum(), dtype=np.float32)]
    rows += [students[split], students[split]]
    cols += [light[split], rng.integers(0, num_heavy, split.sum())]
    weights += [np.full(split.sum(), 2 / 3, dtype=np.float32), np.full(split.sum(), 1 / 3, dtype=np.float32)]
    exact = ~split & (rng.random(student_vocab_size) < 0.8)
    return VocabMap(np.concatenate(rows), np.concatenate(cols), np.concatenate(weights), student_vocab_size,
                    teacher_vocab_size, exact)


def make_heavy_cases(seed: int = 0) -> list[CrossCase]:
    """V_s = 48 (the last 5 rows padding in the second case), V_t = 40, K = 8: the heavy ids 0-2 in every row."""
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    num_rows, vocab, teacher_vocab, k = 16, 48, 40, 8
    cases = []
    for name, real, temperature in (("heavy_map", None, 0.7), ("heavy_map_padding_rows", vocab - 5, 1.0)):
        vmap = heavy_map(real or vocab, teacher_vocab, 3, rng)
        ids, lp = teacher_topk(num_rows, teacher_vocab, k, generator)
        ids[:, :3] = torch.tensor([0, 1, 2])[torch.randperm(3, generator=generator)]
        rest = torch.randperm(teacher_vocab - 3, generator=generator)[: k - 3] + 3
        ids[:, 3:] = torch.stack([rest[torch.randperm(k - 3, generator=generator)] for _ in range(num_rows)])
        lp[3::5, -2:] = float("-inf")  # teacher padding
        logits = 2.0 * torch.randn(num_rows, vocab, generator=generator, dtype=torch.float64)
        cases.append(CrossCase(name, vmap, logits, ids, lp, torch.randn(num_rows, generator=generator,
                                                                           dtype=torch.float64), temperature, real))
    return cases


def check_heavy_tp(min_fan_in: float, min_row_share: float) -> list[dict]:
    """Body for ``run_distributed``: :func:`check_tp`'s and :func:`check_fused_tp`'s comparisons on the heavy-id maps
    with these thresholds of megatron_gkd.losses.cross_vocab.heavy (set in each rank)."""
    cross_vocab_heavy.DENSE_MIN_FAN_IN, cross_vocab_heavy.DENSE_MIN_ROW_SHARE = min_fan_in, min_row_share
    tp_size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    generator = torch.Generator().manual_seed(7)
    results = []
    for case in make_heavy_cases():
        vocab = case.logits.shape[-1]
        valid = torch.isfinite(case.logprobs)
        heavy = cross_vocab_heavy.HeavyColumns.select(case.ids, valid, case.vocab_map.shard(rank, tp_size, vocab // tp_size),
                                                      torch.float64)
        heavy_ids = [] if heavy is None else torch.unique(case.ids[heavy.is_heavy]).tolist()
        hidden = torch.randn(case.logits.shape[0], 12, generator=generator, dtype=torch.float64)
        weight = torch.randn(vocab, 12, generator=generator, dtype=torch.float64)
        for loss_type, options in LOSS_CONFIGS:
            for method in ("projected", "hybrid"):
                for dtype in (torch.float64, torch.float32):
                    loss, grad, _ = run_case(case, loss_type, options, dtype, method, rank, tp_size, group)
                    expected, expected_grad = reference_case(case, loss_type, options, dtype, method)
                    h = hidden.to(dtype, copy=True).requires_grad_()
                    w = shard(weight.t(), rank, tp_size).t().to(dtype, copy=True).requires_grad_()
                    fused_loss, _ = fused_cross_vocab_distill_loss(
                        h, w, case.ids, case.logprobs, case.vocab_map.shard(rank, tp_size, vocab // tp_size, method),
                        loss_type=loss_type, tp_group=group, temperature=case.temperature,
                        real_vocab_size=case.real_vocab_size, chunk_size=5, **options)
                    (fused_loss.double() * case.grad_out).sum().backward()
                    full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                    dense = case.vocab_map.dense_hybrid() if method == "hybrid" else case.vocab_map.dense()
                    fused_expected = reference_cross_vocab_loss(full_h @ full_w.t(), dense, case.ids, case.logprobs,
                                                                loss_type, case.temperature,
                                                                real_vocab_size=case.real_vocab_size, **options)
                    (fused_expected * case.grad_out).sum().backward()
                    results.append({
                        "case": case.name, "loss_type": loss_type, "method": method, "dtype": str(dtype),
                        "heavy_ids": heavy_ids, "loss": relative(loss, expected),
                        "grad": relative(grad, shard(expected_grad, rank, tp_size)),
                        "fused_loss": relative(fused_loss.detach(), fused_expected.detach()),
                        "fused_grad_hidden": relative(h.grad, full_h.grad),
                        "fused_grad_weight": relative(w.grad, shard(full_w.grad.t(), rank, tp_size).t()),
                    })
    return results
