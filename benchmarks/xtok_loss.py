"""Speed and memory of the cross-tokenizer loss against the same-tokenizer loss of the same signal, gloo, 2 ranks.

    python benchmarks/xtok_loss.py                       # V_s=151,936 (151,669 tokens), V_t=128,256, N=4096, K=64
    python benchmarks/xtok_loss.py --num-tokens 2048 --topk 64 256
    python benchmarks/xtok_loss.py --device --repeats 5       # TP=1 on one accelerator
    python benchmarks/xtok_loss.py --torch-ops                # also each method with torch operations, not the kernels
    python benchmarks/xtok_loss.py --per-entry                # ... and with torch operations, every id per entry

Both losses see the same student logit shard and a teacher top-k of the same width: the same-tokenizer loss with
ids in the student's vocabulary (vocab_parallel_distill_loss), the cross-tokenizer loss with ids in the teacher's
(cross_vocab_distill_loss, projected and hybrid). The map is random but shaped like a real one (megatron_gkd.testing.
cross_vocab.random_map): most student tokens one teacher token, a quarter 2-3 pieces drawn from a Zipf-like law
(the first pieces of split words are common teacher tokens, with a large fan-in), 5% unmapped; the teacher's top-k
ids are drawn from a Zipf-like law too, so common ids (the large fan-ins) are in most rows, as in real text.

On the host the map entries are read by numba kernels (megatron_gkd.losses.cross_vocab.kernels); --torch-ops adds
rows with the torch operations instead (the path accelerators take: teacher ids with a large fan-in named by many rows
projected densely, megatron_gkd.losses.cross_vocab.heavy), --per-entry rows with torch operations and that product
off (every id per map entry), measured in the same run.

Reported per loss: forward+backward seconds (minimum of --repeats, wall and CPU), the ratio to the same-tokenizer
loss, and the peak extra resident memory per rank, also in [c, V/tp] chunks (the one scratch chunk of the losses:
1 MiB on the host, 128 MiB on an accelerator, megatron_gkd/losses/shard_ops.py) and as the difference to the
same-tokenizer loss. Memory is measured as in benchmarks/losses.py (VmHWM after clear_refs, mmap for >= 1 MiB).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from losses import _limit_heap_reuse, _merge, _timed

from megatron_gkd.losses.cross_vocab import heavy as cross_vocab_heavy
from megatron_gkd.losses.cross_vocab import kernels as cross_vocab_kernels
from megatron_gkd.losses.shard_ops import ACCELERATOR_CHUNK_ELEMENTS, HOST_CHUNK_ELEMENTS
from megatron_gkd.testing.distributed import run_distributed

STUDENT_ROWS, STUDENT_TOKENS, TEACHER_TOKENS = 151_936, 151_669, 128_256
LOSSES = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {}), ("kl_rkl", {})]
MIB = 1 << 20


def _zipf_ids(num_rows: int, vocab: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct ids per row, low ids (the common tokens of a BPE vocabulary, as in random_map) far more likely."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float32)
    return torch.multinomial(weights.expand(num_rows, vocab), k, replacement=False, generator=generator)


def _logprobs(num_rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    logprobs = torch.log_softmax(2 * torch.randn(num_rows, k, generator=generator), -1) + torch.log(torch.tensor(0.9))
    return logprobs.sort(dim=1, descending=True).values


def _entries_per_row(teacher_ids: torch.Tensor, projection) -> float:
    """Mean number of this shard's map entries under a row's teacher ids (the projection's work per row)."""
    counts = projection.indptr[teacher_ids + 1] - projection.indptr[teacher_ids]
    return counts.sum().item() / teacher_ids.shape[0]


def _variants(torch_ops: bool, per_entry: bool) -> list[tuple[str, bool, float]]:
    """(row label suffix, host kernels on, DENSE_MIN_FAN_IN) of each cross-tokenizer variant timed."""
    variants = [("", True, cross_vocab_heavy.DENSE_MIN_FAN_IN)]
    if torch_ops:
        variants.append((", torch ops", False, cross_vocab_heavy.DENSE_MIN_FAN_IN))
    if per_entry:
        variants.append((", torch ops per entry", False, float("inf")))
    return variants


def _body(num_tokens: int, topks: list[int], repeats: int, skew: float, losses: list[str],
          torch_ops: bool = False, per_entry: bool = False) -> list[dict]:
    from megatron_gkd.losses import vocab_parallel_distill_loss
    from megatron_gkd.losses.cross_vocab.loss import cross_vocab_distill_loss
    from megatron_gkd.testing.cross_vocab import random_map

    _limit_heap_reuse()
    tp_size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    vocab_local = STUDENT_ROWS // tp_size
    vocab_map = random_map(STUDENT_TOKENS, TEACHER_TOKENS, np.random.default_rng(0), skew=skew)
    projections = {method: vocab_map.shard(rank, tp_size, vocab_local, method) for method in ("projected", "hybrid")}
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(num_tokens, STUDENT_ROWS, generator=generator)[:, rank * vocab_local:(rank + 1) * vocab_local]
    x = (2 * logits).contiguous().requires_grad_()
    del logits
    fan_in = np.bincount(vocab_map.teacher_ids, minlength=TEACHER_TOKENS)
    rows = []
    for k in topks:
        student_ids = _zipf_ids(num_tokens, STUDENT_TOKENS, k, generator)
        teacher_ids = _zipf_ids(num_tokens, TEACHER_TOKENS, k, generator)
        logprobs = _logprobs(num_tokens, k, generator)
        map_stats = {"fan_in_of_topk": float(fan_in[teacher_ids.numpy()].mean()), "max_fan_in": int(fan_in.max())}
        for loss_type, options in (entry for entry in LOSSES if entry[0] in losses):
            def same():
                loss, _ = vocab_parallel_distill_loss(x, student_ids, logprobs, loss_type=loss_type, tp_group=group,
                                                      real_vocab_size=STUDENT_TOKENS, **options)
                loss.sum().backward()
                x.grad = None

            rows.append({"method": f"same-tokenizer {loss_type}", "k": k, **_timed(same, repeats)})
            for (method, projection), (suffix, kernels, min_fan_in) in itertools.product(
                    projections.items(), _variants(torch_ops, per_entry)):
                def cross():
                    loss, _ = cross_vocab_distill_loss(x, teacher_ids, logprobs, projection, loss_type=loss_type,
                                                       tp_group=group, real_vocab_size=STUDENT_TOKENS, **options)
                    loss.sum().backward()
                    x.grad = None

                default, cross_vocab_heavy.DENSE_MIN_FAN_IN = cross_vocab_heavy.DENSE_MIN_FAN_IN, min_fan_in
                cross_vocab_kernels.ENABLED = kernels
                rows.append({"method": f"cross {method} {loss_type}{suffix}", "k": k, **_timed(cross, repeats),
                             **map_stats, "entries_per_row": _entries_per_row(teacher_ids, projection)})
                cross_vocab_heavy.DENSE_MIN_FAN_IN, cross_vocab_kernels.ENABLED = default, True
                if rank == 0:
                    print(f"  K={k} {loss_type} {method}{suffix}: {rows[-1]['cpu']:.3f} s cpu", file=sys.stderr,
                          flush=True)
    return rows


def _device_body(num_tokens: int, topks: list[int], repeats: int, skew: float, losses: list[str]) -> list[dict]:
    """TP=1 on one accelerator (the whole student vocabulary): milliseconds (median, device finished) and peak
    extra device memory of each loss."""
    from megatron_gkd import platform
    from megatron_gkd.losses import vocab_parallel_distill_loss
    from megatron_gkd.losses.cross_vocab.loss import cross_vocab_distill_loss
    from megatron_gkd.testing.cross_vocab import random_map

    device = platform.device()
    vocab_map = random_map(STUDENT_TOKENS, TEACHER_TOKENS, np.random.default_rng(0), skew=skew)
    projections = {method: vocab_map.shard(0, 1, STUDENT_ROWS, method, device=device)
                   for method in ("projected", "hybrid")}
    generator = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(num_tokens, STUDENT_ROWS, generator=generator)).to(device).requires_grad_()

    def timed(fn) -> dict:
        fn()
        times = []
        for _ in range(repeats):
            platform.synchronize()
            start = time.perf_counter()
            fn()
            platform.synchronize()
            times.append(time.perf_counter() - start)
        before = platform.memory_allocated()
        platform.max_memory_allocated(reset=True)
        fn()
        platform.synchronize()
        return {"seconds": statistics.median(times), "cpu": statistics.median(times),
                "mib": (platform.max_memory_allocated() - before) / MIB}

    rows = []
    for k in topks:
        student_ids = _zipf_ids(num_tokens, STUDENT_TOKENS, k, generator).to(device)
        teacher_ids = _zipf_ids(num_tokens, TEACHER_TOKENS, k, generator).to(device)
        logprobs = _logprobs(num_tokens, k, generator).to(device)
        for loss_type, options in (entry for entry in LOSSES if entry[0] in losses):
            def same():
                loss, _ = vocab_parallel_distill_loss(x, student_ids, logprobs, loss_type=loss_type, tp_group=None,
                                                      real_vocab_size=STUDENT_TOKENS, **options)
                loss.sum().backward()
                x.grad = None

            rows.append({"method": f"same-tokenizer {loss_type}", "k": k, **timed(same)})
            for method, projection in projections.items():
                def cross():
                    loss, _ = cross_vocab_distill_loss(x, teacher_ids, logprobs, projection, loss_type=loss_type,
                                                       tp_group=None, real_vocab_size=STUDENT_TOKENS, **options)
                    loss.sum().backward()
                    x.grad = None

                rows.append({"method": f"cross {method} {loss_type}", "k": k, **timed(cross),
                             "entries_per_row": _entries_per_row(teacher_ids, projection)})
    return rows


def _table(rows: list[dict], vocab_local: int) -> str:
    host_chunk = HOST_CHUNK_ELEMENTS // vocab_local * vocab_local * 4 / MIB
    device_chunk = ACCELERATOR_CHUNK_ELEMENTS // vocab_local * vocab_local * 4 / MIB
    lines = [
        f"chunk [c, V/tp] fp32: {host_chunk:.2f} MiB on the host (c={HOST_CHUNK_ELEMENTS // vocab_local}), "
        f"{device_chunk:.0f} MiB on an accelerator (c={ACCELERATOR_CHUNK_ELEMENTS // vocab_local})",
        "",
        "| loss | K | wall s | x same (wall) | cpu s | x same (cpu) | peak extra MiB/rank | over same, MiB | "
        "over same, host chunks | over same, accelerator chunks | map entries / row |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = None
    for row in rows:
        if row["method"].startswith("same"):
            base = row
            lines.append(f"| {row['method']} | {row['k']} | {row['seconds']:.3f} | 1 | {row['cpu']:.3f} | 1 | "
                         f"{row['mib']:.0f} | - | - | - | - |")
            continue
        extra = row["mib"] - base["mib"]
        lines.append(
            f"| {row['method']} | {row['k']} | {row['seconds']:.3f} | {row['seconds'] / base['seconds']:.2f} | "
            f"{row['cpu']:.3f} | {row['cpu'] / base['cpu']:.2f} | {row['mib']:.0f} | {extra:.0f} | "
            f"{extra / host_chunk:.1f} | {extra / device_chunk:.2f} | {row['entries_per_row']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, nargs="+", default=[64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skew", type=float, default=2.0, help="Zipf-like skew of the map's pieces (0: uniform)")
    parser.add_argument("--losses", nargs="+", default=[name for name, _ in LOSSES], help="a subset of the divergences")
    parser.add_argument("--torch-ops", action="store_true",
                        help="also time each method with torch operations instead of the host kernels (gloo runs)")
    parser.add_argument("--per-entry", action="store_true",
                        help="also time each method with torch operations and the heavy ids' dense product off")
    parser.add_argument("--device", action="store_true",
                        help="TP=1 on one accelerator (the platform's device) instead of 2 gloo ranks on the host")
    args = parser.parse_args()
    if args.device:
        print(f"# one accelerator, TP=1, N={args.num_tokens}, V_s={STUDENT_ROWS} ({STUDENT_TOKENS} tokens), "
              f"V_t={TEACHER_TOKENS}, fp32 logits, map skew {args.skew}; seconds are medians, memory is the device's")
        rows = run_distributed(_device_body, 1, args=(args.num_tokens, args.topk, args.repeats, args.skew, args.losses),
                               platform_name=None, timeout=3600)[0]
        print(_table(rows, STUDENT_ROWS))
        return
    world = 2
    print(f"# gloo, {world} ranks x 1 thread, N={args.num_tokens}, V_s={STUDENT_ROWS} ({STUDENT_TOKENS} tokens, "
          f"V_s/tp={STUDENT_ROWS // world}), V_t={TEACHER_TOKENS}, fp32 logits, map skew {args.skew}")
    rows = _merge(run_distributed(_body, world, args=(args.num_tokens, args.topk, args.repeats, args.skew, args.losses,
                                                      args.torch_ops, args.per_entry), timeout=3600))
    first = next(row for row in rows if not row["method"].startswith("same"))
    print(f"teacher top-k ids' mean fan-in {first['fan_in_of_topk']:.1f}, largest fan-in in the map {first['max_fan_in']}")
    print(_table(rows, STUDENT_ROWS // world))


if __name__ == "__main__":
    main()
