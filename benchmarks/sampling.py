"""The cost of one sampled token on the host: ``sample_next`` (the hf engine's and the hf and megatron teacher
backends' draw) against two baselines and the floor, per policy, at a real vocabulary.

    .venv/bin/python benchmarks/sampling.py                        # 16 rows x 151,936 ids (Qwen3), 2 threads
    .venv/bin/python benchmarks/sampling.py --rows 64 --vocab 32768

- ``sample_next``: the policy's cuts, then one float64 uniform a row inverted on the id-ordered cumulative mass.
- baseline ``multinomial``: HF ``generate``'s draw (softmax over the cut row, ``torch.multinomial`` a row, which
  draws one exponential per id).
- baseline ``sorted``: our draw until 2026-11-27 (a stable sort of the row, the cuts, one exponential per id).
- floor: one softmax over the row, which every draw pays.

Each figure is the minimum over ``--repeats`` of the mean over ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_gkd.rollout.sampling import draw_uniforms, sample_next

POLICIES = {"no cut": (0, 1.0), "top_k=50": (50, 1.0), "top_p=0.9": (0, 0.9)}


def multinomial_draw(scores: torch.Tensor, generators: list[torch.Generator], top_k: int, top_p: float) -> torch.Tensor:
    """HF's warpers (mask in id order) and one ``torch.multinomial`` a row."""
    if top_k:
        scores = scores.masked_fill(scores < torch.topk(scores, top_k, dim=-1).values[:, -1:], -torch.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        dropped = probs.cumsum(dim=-1) - probs >= top_p
        scores = scores.masked_fill(dropped.scatter(1, order, dropped), -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.stack([torch.multinomial(row, 1, generator=g)[0] for row, g in zip(probs, generators)])


def sorted_draw(scores: torch.Tensor, generators: list[torch.Generator], top_k: int, top_p: float) -> torch.Tensor:
    """The draw this one replaced: a stable sort, the cuts, ``argmax(p / q)`` with ``q ~ Exp(1)`` per column."""
    ordered, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    if top_k:
        ordered[:, top_k:] = -torch.inf
    probs = torch.softmax(ordered, dim=-1)
    if top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        row.exponential_(1.0, generator=generator)
    return order.gather(1, (probs / noise).argmax(dim=-1)[:, None])[:, 0]


def seconds(call, calls: int, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scores = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    generators = [torch.Generator().manual_seed(row) for row in range(args.rows)]
    floor = seconds(lambda: torch.softmax(scores, dim=-1), args.calls, args.repeats)
    print(f"{args.rows} rows x {args.vocab} ids, {args.threads} threads; ms a sampled token (x the floor)")
    print(f"floor (one softmax): {floor * 1e3:.2f} ms")
    print(f"{'policy':<10} {'sample_next':>16} {'multinomial':>16} {'sorted':>16}")
    for name, (top_k, top_p) in POLICIES.items():
        # A uniform a row drawn per token, as a teacher backend would (the hf engine draws a response's at once).
        ours = seconds(lambda: sample_next(scores, draw_uniforms(generators, 1)[:, 0], temperature=1.0, top_k=top_k,
                                           top_p=top_p), args.calls, args.repeats)
        hf = seconds(lambda: multinomial_draw(scores, generators, top_k, top_p), args.calls, args.repeats)
        old = seconds(lambda: sorted_draw(scores, generators, top_k, top_p), args.calls, args.repeats)
        print(f"{name:<10} " + " ".join(f"{t * 1e3:8.2f} ({t / floor:4.1f}x)" for t in (ours, hf, old)))


if __name__ == "__main__":
    main()
