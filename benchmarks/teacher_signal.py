"""What the teacher's hidden signal costs against its top-k: bytes on the wire, loss time, loss memory.

    python benchmarks/teacher_signal.py                       # V=151936, N=4096, h_t in {2048, 5120, 7168}, TP=2
    python benchmarks/teacher_signal.py --num-tokens 1024 --teacher-hidden 2048   # a quick look

1. Bytes per response token of a RESULT message, measured by encoding one (``codec.encode_result``, the
   frames as they are sent, header included, divided by the tokens): hidden states in bf16 at each teacher
   width, the top-64 and top-256 rows, and the full logits a server would otherwise send (V fp32 values,
   computed: the protocol has no such message).
2. The loss, forward + backward, under gloo with 2 ranks x 1 thread (each rank holds V/2 of the vocabulary):
   the student is fused (its last hidden states and output-layer shard, ``--student-hidden`` wide, fp32) in
   both paths. ``top-64``: :func:`fused_vocab_parallel_distill_loss` on the teacher's top-64 (forward KL).
   ``hidden``: :func:`hidden_distill_loss` from the teacher's hidden states and its head shard (forward KL
   over the whole vocabulary by default; ``--losses`` adds others). The floor is the student's fused output layer alone: its
   logits, a log-softmax and the two gradient matmuls (``log_softmax(h W^T)`` summed, backward).
   Wall and CPU seconds (minimum of ``--repeats``) and the peak extra resident memory per rank (see
   benchmarks/losses.py for how it is measured), against what materialising both models' ``[N, V/tp]``
   fp32 logits would take.

Targets (issue #19): hidden <= 3x the top-64 loss time; its peak extra memory <= 1/8 of both models'
full logits.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from losses import _limit_heap_reuse, _merge, _peak_extra_mib, _teacher

from megatron_gkd.testing.distributed import run_distributed

VOCAB = 151936
MIB = 1 << 20


def wire_bytes_per_token(num_tokens: int, teacher_hidden: list[int], vocab: int) -> list[dict]:
    """Bytes per token of RESULT messages of each signal (encoded, not estimated)."""
    from megatron_gkd.teacher import TeacherOutput
    from megatron_gkd.teacher.protocol.codec import encode_result

    rng = np.random.default_rng(0)
    token_logprobs = -rng.random(num_tokens).astype(np.float32)
    rows = []
    for k in (64, 256):
        ids = np.tile(np.arange(k, dtype=np.int64), (num_tokens, 1))
        logprobs = np.sort(-rng.random((num_tokens, k)).astype(np.float32) - 3, axis=1)[:, ::-1].copy()
        output = TeacherOutput(topk_ids=ids, topk_logprobs=logprobs, token_logprobs=token_logprobs)
        frames = encode_result("bench", [output], None)
        rows.append({"signal": f"top-{k} (int32 ids + fp32 log-probs)", "bytes": sum(map(len, frames)) / num_tokens})
    for hidden in teacher_hidden:
        output = TeacherOutput(topk_ids=np.zeros((num_tokens, 0), np.int64),
                               topk_logprobs=np.zeros((num_tokens, 0), np.float32), token_logprobs=token_logprobs,
                               hidden=rng.standard_normal((num_tokens, hidden)).astype(np.float32))
        frames = encode_result("bench", [output], None, hidden_dtype="bfloat16")
        rows.append({"signal": f"hidden bf16, h={hidden}", "bytes": sum(map(len, frames)) / num_tokens})
    rows.append({"signal": f"full logits fp32 (V={vocab}, computed)", "bytes": 4.0 * vocab})
    return rows


def _timed(fn, repeats: int) -> dict:
    """Minimum wall and CPU seconds over ``repeats`` calls, the first of which also measures the peak extra
    memory (at these sizes one call is tens of seconds: first-call overheads are noise)."""
    walls, cpus, mib = [], [], None
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        if mib is None:
            mib = _peak_extra_mib(fn)
        else:
            fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    dist.barrier()
    return {"seconds": min(walls), "cpu": min(cpus), "mib": mib}


def _loss_body(num_tokens: int, vocab: int, student_hidden: int, teacher_hidden: list[int], chunk_size: int,
               repeats: int, losses: list[str]) -> list[dict]:
    from megatron_gkd.losses import fused_vocab_parallel_distill_loss, hidden_distill_loss

    _limit_heap_reuse()
    torch.set_num_threads(1)
    group = dist.group.WORLD
    vocab_local = vocab // dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, student_hidden, generator=generator).requires_grad_()
    weight = (torch.randn(vocab_local, student_hidden, generator=generator) / student_hidden**0.5).requires_grad_()
    weights = torch.full((num_tokens,), 1.0 / num_tokens)
    ids, logprobs = _teacher(num_tokens, vocab, 64, generator)

    def clear():
        hidden.grad = weight.grad = None

    def floor():
        torch.log_softmax(hidden @ weight.t(), dim=-1).sum().backward()
        clear()

    def topk():
        loss, _ = fused_vocab_parallel_distill_loss(hidden, weight, ids, logprobs, loss_type="forward_kl",
                                                    tp_group=group, chunk_size=chunk_size)
        (loss * weights).sum().backward()
        clear()

    rows = [{"method": "floor: student output layer + log_softmax", **_timed(floor, repeats)},
            {"method": "top-64 fused forward_kl", **_timed(topk, repeats)}]
    _progress(rows)
    for width in teacher_hidden:
        teacher = torch.randn(num_tokens, width, generator=generator).to(torch.bfloat16).float()
        head = torch.randn(vocab_local, width, generator=generator) / width**0.5
        for loss_type in losses:
            def run(teacher=teacher, head=head):
                total, _, _ = hidden_distill_loss(hidden, teacher, head, weights, student_weight=weight,
                                                  loss_type=loss_type, tp_group=group, chunk_size=chunk_size)
                total.backward()
                clear()

            rows.append({"method": f"hidden {loss_type}, h_t={width}", **_timed(run, repeats)})
            _progress(rows)
        del teacher, head
    return rows


def _progress(rows: list[dict]) -> None:
    if dist.get_rank() == 0:
        row = rows[-1]
        print(f"  rank 0: {row['method']}: {row['seconds']:.2f} s wall, {row['cpu']:.2f} s cpu, {row['mib']:.0f} MiB",
              file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--student-hidden", type=int, default=1024)
    parser.add_argument("--teacher-hidden", type=int, nargs="+", default=[2048, 5120, 7168])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--losses", nargs="+", default=["forward_kl"],
                        help="hidden-path divergences to time (they share the matmuls; reverse_kl and jsd add "
                             "elementwise passes)")
    args = parser.parse_args()
    world = 2
    print(f"# bytes per response token of a RESULT message (N={args.num_tokens})")
    print("| signal | bytes/token | x hidden bf16 of the widest teacher |\n|---|---|---|")
    wire = wire_bytes_per_token(args.num_tokens, args.teacher_hidden, args.vocab)
    widest = next(row["bytes"] for row in wire if row["signal"] == f"hidden bf16, h={max(args.teacher_hidden)}")
    for row in wire:
        print(f"| {row['signal']} | {row['bytes']:,.0f} | {row['bytes'] / widest:.2f} |")
    both_logits = 2 * args.num_tokens * (args.vocab // world) * 4 / MIB
    print(f"\n# loss forward+backward: gloo, {world} ranks x 1 thread, N={args.num_tokens}, V={args.vocab} "
          f"(V/tp={args.vocab // world}), student h={args.student_hidden} fp32, chunk {args.chunk_size} tokens; "
          f"both models' full [N, V/tp] fp32 logits: {both_logits:,.0f} MiB/rank")
    rows = _merge(run_distributed(_loss_body, world, args=(args.num_tokens, args.vocab, args.student_hidden,
                                                           args.teacher_hidden, args.chunk_size, args.repeats,
                                                           args.losses),
                                  timeout=7200))
    floor, topk = rows[0], rows[1]
    # Every path ends holding the student's gradients (output-layer shard and hidden states, fp32): the
    # memory of the loss itself is what lies above them.
    grads = (args.vocab // world + args.num_tokens) * args.student_hidden * 4 / MIB
    print(f"student gradients every path returns: {grads:,.0f} MiB/rank")
    print("| method | wall s | x floor | x top-64 | cpu s | x top-64 (cpu) | peak extra MiB/rank | above the gradients "
          "| / both logits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['method']} | {row['seconds']:.2f} | {row['seconds'] / floor['seconds']:.2f} "
              f"| {row['seconds'] / topk['seconds']:.2f} | {row['cpu']:.2f} | {row['cpu'] / topk['cpu']:.2f} "
              f"| {row['mib']:,.0f} | {row['mib'] - grads:,.0f} | {(row['mib'] - grads) / both_logits:.3f} |")


if __name__ == "__main__":
    main()
