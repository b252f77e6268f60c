"""Speed and memory of the vocab-parallel distillation losses, under gloo with 2 ranks (1 thread each).

    python benchmarks/losses.py                 # N=4096, V=32768, K in {64, 256}, every loss
    python benchmarks/losses.py --large         # V=151936 (no naive baseline: it needs ~10 GiB/rank)
    python benchmarks/losses.py --fused-tokens 16384   # also fused vs unfused output layer + loss

For each loss: forward+backward seconds (minimum of --repeats, wall and CPU time) and peak extra memory per rank, next to
(a) a naive baseline that all-gathers the vocabulary and runs the dense fp32 formulas with autograd and
(b) the floor: one fp32 ``log_softmax`` forward+backward over the local shard.

Memory is the peak resident set size (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) minus
the resident size before the call; glibc is told to serve every allocation of 1 MiB or more with
``mmap`` (``mallopt``) so freed buffers leave the resident set and a later peak is not hidden by reuse.
``tracemalloc`` does not see torch's allocations and torch has no CPU allocator statistics.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch
import torch.distributed as dist

from megatron_gkd.testing.distributed import run_distributed

LOSSES = [
    ("forward_kl", {}),
    ("reverse_kl", {}),
    ("jsd", {}),
    ("kl_rkl", {}),
    ("tcad", {}),
]
MIB = 1 << 20


def _limit_heap_reuse() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, MIB)  # M_MMAP_THRESHOLD: a fixed threshold also disables glibc's dynamic raise
    libc.mallopt(-1, MIB)  # M_TRIM_THRESHOLD


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_extra_mib(fn) -> float:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current resident size
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def _progress(row: dict) -> None:
    if dist.get_rank() == 0:
        print(f"  rank 0: {row['method']} K={row['k']}: {row['seconds']:.3f} s wall, {row['cpu']:.3f} s cpu, "
              f"{row['mib']:.0f} MiB",
              file=sys.stderr, flush=True)


def _timed(fn, repeats: int) -> dict:
    """Minimum wall and CPU (user + system, this process) seconds over ``repeats``, and peak memory.

    Minima, and CPU time next to wall time, because the machine is shared: a rank that is descheduled
    accrues wall time but not CPU time.
    """
    fn()  # warm-up
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    dist.barrier()
    return {"seconds": min(walls), "cpu": min(cpus), "mib": _peak_extra_mib(fn)}


def _teacher(num_tokens: int, vocab: int, k: int, generator: torch.Generator):
    """Distinct ids spread over the whole vocabulary (so over both shards) and sorted log-probs."""
    stride = vocab // k
    offsets = torch.randint(0, stride, (num_tokens, k), generator=generator)
    ids = (torch.arange(k) * stride + offsets + torch.randint(0, vocab, (num_tokens, 1), generator=generator)) % vocab
    logprobs = torch.log_softmax(2 * torch.randn(num_tokens, k, generator=generator), -1) + torch.log(torch.tensor(0.9))
    logprobs, order = logprobs.sort(dim=1, descending=True)
    return ids.gather(1, order), logprobs


def _loss_body(num_tokens: int, vocab: int, topks: list[int], repeats: int, naive: bool) -> list[dict]:
    from megatron_gkd.losses import vocab_parallel_distill_loss
    from megatron_gkd.losses.reference import reference_distill_loss

    _limit_heap_reuse()
    tp_size, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    vocab_local = vocab // tp_size
    generator = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(num_tokens, vocab, generator=generator))[:, rank * vocab_local:(rank + 1) * vocab_local].clone()
    x = logits.requires_grad_()
    upstream = torch.randn(num_tokens, vocab_local)
    rows = []

    def floor():
        torch.log_softmax(x, dim=-1).backward(upstream)
        x.grad = None

    rows.append({"method": "floor: log_softmax fwd+bwd (local shard)", "k": "-", **_timed(floor, repeats)})
    _progress(rows[-1])
    for k in topks:
        ids, logprobs = _teacher(num_tokens, vocab, k, generator)
        for loss_type, options in LOSSES:
            def ours():
                loss, _ = vocab_parallel_distill_loss(x, ids, logprobs, loss_type=loss_type, tp_group=group, **options)
                loss.sum().backward()
                x.grad = None

            rows.append({"method": loss_type, "k": k, **_timed(ours, repeats)})
            _progress(rows[-1])
            if not naive:
                continue

            def gathered():
                pieces = [torch.empty_like(logits) for _ in range(tp_size)]
                dist.all_gather(pieces, x.detach())
                full = torch.cat(pieces, dim=1).requires_grad_()
                del pieces
                loss = reference_distill_loss(full, ids, logprobs, loss_type, dtype=torch.float32, **options)
                loss.sum().backward()
                x.grad = full.grad[:, rank * vocab_local:(rank + 1) * vocab_local].contiguous()
                x.grad = None

            rows.append({"method": f"naive gather {loss_type}", "k": k, **_timed(gathered, 1)})
            _progress(rows[-1])
    return rows


def _fused_body(num_tokens: int, vocab: int, hidden_size: int, k: int, chunk_size: int) -> list[dict]:
    from megatron_gkd.losses import fused_vocab_parallel_distill_loss, vocab_parallel_distill_loss

    _limit_heap_reuse()
    tp_size = dist.get_world_size()
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).requires_grad_()
    weight = (torch.randn(vocab // tp_size, hidden_size, generator=generator) / hidden_size**0.5).requires_grad_()
    ids, logprobs = _teacher(num_tokens, vocab, k, generator)

    def unfused():
        loss, _ = vocab_parallel_distill_loss(hidden @ weight.t(), ids, logprobs, loss_type="forward_kl", tp_group=group)
        loss.sum().backward()
        hidden.grad = weight.grad = None

    def fused():
        loss, _ = fused_vocab_parallel_distill_loss(
            hidden, weight, ids, logprobs, loss_type="forward_kl", tp_group=group, chunk_size=chunk_size
        )
        loss.sum().backward()
        hidden.grad = weight.grad = None

    rows = []
    for name, fn in (("unfused: output layer + forward_kl", unfused), (f"fused (chunk {chunk_size})", fused)):
        rows.append({"method": name, "k": k, **_timed(fn, 1)})
        _progress(rows[-1])
    return rows


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's row with the larger times and memory of the ranks."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in ("seconds", "cpu", "mib"):
            row[key] = max(r[key] for r in rows)
        merged.append(row)
    return merged


def _table(rows: list[dict], floor: dict | None) -> str:
    lines = [
        "| method | K | wall s | x floor (wall) | cpu s | x floor (cpu) | peak extra MiB/rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        wall = f"{row['seconds'] / floor['seconds']:.2f}" if floor else "-"
        cpu = f"{row['cpu'] / floor['cpu']:.2f}" if floor else "-"
        lines.append(
            f"| {row['method']} | {row['k']} | {row['seconds']:.3f} | {wall} | {row['cpu']:.3f} | {cpu} "
            f"| {row['mib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="V=151936 instead of 32768")
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-naive", action="store_true", help="skip the vocabulary-gather baseline")
    parser.add_argument("--fused-tokens", type=int, default=0, help="also compare fused vs unfused at this N")
    parser.add_argument("--fused-only", action="store_true", help="only the fused vs unfused comparison")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=1024)
    args = parser.parse_args()
    vocab = 151936 if args.large else 32768
    naive = not (args.no_naive or args.large)
    world = 2
    if not args.fused_only:
        print(f"# gloo, {world} ranks x 1 thread, N={args.num_tokens}, V={vocab} (V/tp={vocab // world}), fp32")
        rows = _merge(run_distributed(
            _loss_body, world, args=(args.num_tokens, vocab, args.topk, args.repeats, naive), timeout=3600
        ))
        print(_table(rows, rows[0]))
    if args.fused_tokens:
        print(f"\n# fused vs unfused: N={args.fused_tokens}, h={args.hidden_size}, V={vocab}, forward_kl")
        fused = _merge(run_distributed(
            _fused_body, world, args=(args.fused_tokens, vocab, args.hidden_size, args.topk[0], args.chunk_size),
            timeout=3600,
        ))
        print(_table(fused, None))
        print(f"fused / unfused peak memory: {fused[1]['mib'] / fused[0]['mib']:.3f}")


if __name__ == "__main__":
    main()
