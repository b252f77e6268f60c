"""The update phase of one step (forward, backward, optimizer) of a real Megatron student under gloo:
distillation against k teacher entries (unfused and fused) next to an SFT cross-entropy step on the same
tokens (the baseline) and a floor (the same model with the cheapest loss on its logits, their mean, taken in
the output layer's own layout as the distillation step takes them); and the three ways of training on rewards
with the teacher (``rl.combine``: the policy-gradient term plus the divergence, or the teacher in the advantage),
against the distillation step alone (issue 28's target: <= 1.1x).

    python benchmarks/train_step.py                       # TP=2, V=32768, 4 x 512 tokens, k=64
    python benchmarks/train_step.py --tp 1 --vocab 65536 --top-k 256
    python benchmarks/train_step.py --platform cuda --tp 1 --vocab 151936 --hidden 1024   # one GPU, NCCL

Time: median of --repeats steps per variant, variants interleaved in one run (each rank has 1 thread; on an
accelerator the clock stops after the device has finished).
Memory: the peak of live tensor bytes during one step above those live before it, rank 0: on the host from
the torch profiler's allocation events (``megatron_gkd.testing.memory.LiveTensorPeak``: the host analogue
of ``max_memory_allocated``), on an accelerator from its allocator's ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial

import torch

from megatron_gkd.platform import PLATFORM_NAMES
from megatron_gkd.testing.distributed import run_distributed

VARIANTS = ("floor", "sft_cross_entropy", "distill_unfused", "distill_fused", "rl_loss_unfused", "rl_loss_fused",
            "rl_advantage_unfused", "rl_teacher_unfused")
# (rl.combine, fused) of the reward variants; each is compared with the distillation step of its path.
RL_VARIANTS = {"rl_loss_unfused": ("loss", False), "rl_loss_fused": ("loss", True),
               "rl_advantage_unfused": ("advantage", False), "rl_teacher_unfused": ("teacher", False)}


def _microbatches(args, vocab: int):
    from megatron_gkd.trainer.batch import PolicyShare, Sample, TeacherRows, build_microbatch, token_coefficients

    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(args.batch):
        tokens = torch.randint(3, vocab, (args.seq + 1,), generator=generator)
        behaviour = -torch.rand(args.seq + 1 - args.prompt, generator=generator) * 5  # the rollout's log-probs
        samples.append(Sample(tokens=tokens, prompt_len=args.prompt, group=len(samples), prompt_index=0,
                              logprobs=behaviour))
    lengths = [s.response_len for s in samples]
    logits = torch.randn(sum(lengths), vocab, generator=generator) * 3
    logprobs, ids = torch.log_softmax(logits, -1).topk(args.top_k, dim=-1)
    rows = TeacherRows(ids, logprobs, logprobs[:, 0])
    coefficients = token_coefficients(samples, total_tokens=sum(lengths), num_groups=len(samples))
    per_sample = rows.split(lengths)
    # The policy-gradient inputs: +-1 advantages, the token mean, the teacher's log-prob of each sampled token.
    policy = PolicyShare([1.0 if i % 2 else -1.0 for i in range(len(samples))], coefficients,
                         list(rows.token_logprobs.split(lengths)))
    cut = [list(range(i, min(i + args.micro, len(samples)))) for i in range(0, len(samples), args.micro)]
    build = lambda labels, with_rows, with_policy=False: [  # noqa: E731
        build_microbatch([samples[i] for i in idx], [coefficients[i] for i in idx],
                         rows=[per_sample[i] for i in idx] if with_rows else None, labels=labels,
                         policy=policy.take(idx) if with_policy else None) for idx in cut]
    return build(False, True), build(True, False), build(False, True, True), build(False, False, True)


def _body(args, checkpoint: str):
    import torch.distributed as dist

    from megatron_gkd import parallel, platform
    from megatron_gkd.losses.combinations import get_combination
    from megatron_gkd.models import load_hf
    from megatron_gkd.testing.memory import LiveTensorPeak
    from megatron_gkd.trainer.logit_capture import capture_logits
    from megatron_gkd.trainer.optim import OptimizerConfig, build_lr_scheduler, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.specs import LossSpec, PolicySpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(tensor_model_parallel_size=args.tp)
    config = OptimizerConfig(lr=1e-5)
    chunks = wrap_for_training(load_hf(checkpoint), config)
    optimizer = build_optimizer(config, chunks)
    runner = StepRunner(chunks, optimizer, build_lr_scheduler(config, optimizer, 1000), tp_group=state.tp_group,
                        dp_group=state.dp_gloo_group, dp_size=1, is_last_stage=True)
    distill, sft, combined, advantage_only = _microbatches(args, args.vocab)
    specs = {"sft_cross_entropy": (LossSpec(kind="cross_entropy"), sft),
             "distill_unfused": (LossSpec(loss_type="forward_kl"), distill),
             "distill_fused": (LossSpec(loss_type="forward_kl", fused=True, chunk_size=args.chunk), distill)}
    runners = {}
    for name, (combine, fused) in RL_VARIANTS.items():
        combination = get_combination(combine)
        runners[name] = StepRunner(chunks, optimizer, runner.lr_scheduler, tp_group=state.tp_group,
                                   dp_group=state.dp_gloo_group, dp_size=1, is_last_stage=True,
                                   policy=PolicySpec(combination=combination, fused=fused, chunk_size=args.chunk))
        specs[name] = (specs["distill_fused" if fused else "distill_unfused"][0],
                       combined if combination.uses_divergence else advantage_only)

    def floor_step():
        from megatron.core.distributed import finalize_model_grads  # noqa: F401 - set by the runner

        from megatron_gkd.parallel import run_schedule

        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()

        def forward_step(iterator, model):
            mb = next(iterator)
            with capture_logits(model) as captured:
                output = model(mb.tokens.to(platform.device()), mb.position_ids.to(platform.device()), attention_mask=None)
            return output, lambda _: (captured.logits.float().mean() * len(distill), {})

        run_schedule(chunks, forward_step, distill, seq_length=args.seq, micro_batch_size=args.micro, forward_only=False)
        optimizer.step()

    steps = {"floor": floor_step}
    steps.update({name: partial(runners.get(name, runner).train_step, spec, mbs) for name, (spec, mbs) in specs.items()})
    for step in steps.values():  # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            platform.synchronize()
            dist.barrier()
            start = time.perf_counter()
            step()
            platform.synchronize()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    memory = {}
    for name, step in steps.items():
        if platform.current().name == "cpu":
            with LiveTensorPeak() as meter:
                with meter.region(name):
                    step()
            memory[name] = meter.peak(name)
        else:
            platform.synchronize()
            before = platform.memory_allocated()
            platform.max_memory_allocated(reset=True)
            step()
            platform.synchronize()
            memory[name] = platform.max_memory_allocated() - before
    parallel.destroy()
    return {name: statistics.median(values) for name, values in times.items()}, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="samples per step")
    parser.add_argument("--micro", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sample (prompt + response - 1)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sample")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256, help="fused path: tokens per chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--platform", default="cpu", choices=PLATFORM_NAMES,
                        help="where the ranks run (an accelerator: one device per rank)")
    args = parser.parse_args()
    from megatron_gkd.recipes.tiny import build_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = str(build_checkpoint(directory, vocab_size=args.vocab, hidden_size=args.hidden,
                                          num_layers=args.layers, num_heads=args.hidden // 64,
                                          num_kv_heads=max(args.tp, 1), intermediate_size=2 * args.hidden))
        (times, memory), *_ = run_distributed(_body, args.tp, args=(args, checkpoint), timeout=3600,
                                              platform_name=args.platform)
    base, floor = times["sft_cross_entropy"], times["floor"]
    print(f"{args.platform}, TP={args.tp}, V={args.vocab}, {args.batch} x {args.seq} tokens ({args.batch // args.micro} micro-batches), "
          f"k={args.top_k}, hidden {args.hidden}, {args.layers} layers")
    print(f"{'variant':20s} {'step s':>8s} {'/ SFT CE':>9s} {'/ floor':>8s} {'/ distill':>9s} {'peak MiB':>9s}")
    for name in VARIANTS:
        distill = times["distill_fused" if RL_VARIANTS.get(name, ("", False))[1] else "distill_unfused"]
        print(f"{name:20s} {times[name]:8.3f} {times[name] / base:9.3f} {times[name] / floor:8.3f} "
              f"{times[name] / distill:9.3f} {memory[name] / 2**20:9.1f}")


if __name__ == "__main__":
    main()
