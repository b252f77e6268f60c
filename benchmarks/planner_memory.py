"""The planner's predicted training memory per rank against the peak measured on the CPU.

For each case, tiny HF-architecture models are trained two steps by Megatron-Core on gloo ranks
(local layer spec, Megatron's DDP with a float32 gradient buffer, Megatron's Adam, 1F1B pipeline
schedules, cross-entropy loss) under ``megatron_gkd.testing.memory.LiveTensorPeak``: the peak of live
tensor bytes during the training steps, counted from before the model was built (the host analogue
of the accelerator allocator's ``max_memory_allocated``). The planner (``megatron_gkd.planning.plan_student`` with
``kernels="local"``) predicts the same quantity from the config alone::

    flock /tmp/gkd-heavy.lock python benchmarks/planner_memory.py [--cases tp1-llama tp2-qwen3 ...] [--json]

Prints a Markdown table: per rank, measured and predicted MiB and predicted / measured.
"""

from __future__ import annotations

import argparse
import json

from megatron_gkd.testing.planner_memory import QWEN3_0_6B_SHAPE, MemoryCase

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseekv3": "DeepseekV3ForCausalLM",
}


def _cases() -> list[MemoryCase]:
    cases = [MemoryCase(f"tp1-{short}", arch, 1) for short, arch in ARCHITECTURES.items()]
    tp2 = dict(tensor_model_parallel_size=2)
    cases += [
        MemoryCase("tp2-llama", "LlamaForCausalLM", 2, tp2),
        MemoryCase("tp2-qwen3", "Qwen3ForCausalLM", 2, tp2),
        MemoryCase("tp2-sp-qwen2", "Qwen2ForCausalLM", 2, dict(tp2, sequence_parallel=True)),
        MemoryCase("tp2-sp-deepseekv3", "DeepseekV3ForCausalLM", 2, dict(tp2, sequence_parallel=True)),
        MemoryCase("pp2-llama", "LlamaForCausalLM", 2, dict(pipeline_model_parallel_size=2)),
        MemoryCase("pp2-qwen2-tied", "Qwen2ForCausalLM", 2, dict(pipeline_model_parallel_size=2)),
        MemoryCase(
            "pp2-vpp2-qwen3",
            "Qwen3ForCausalLM",
            2,
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ),
        MemoryCase("ep2-qwen3moe", "Qwen3MoeForCausalLM", 2, dict(expert_model_parallel_size=2)),
        MemoryCase("ep2-deepseekv3", "DeepseekV3ForCausalLM", 2, dict(expert_model_parallel_size=2)),
        MemoryCase("dp2-distopt-llama", "LlamaForCausalLM", 2, use_distributed_optimizer=True),
        MemoryCase("tp1-bf16-llama", "LlamaForCausalLM", 1, bf16=True),
        MemoryCase(
            "tp1-recompute-full-llama",
            "LlamaForCausalLM",
            1,
            recompute=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        ),
        MemoryCase(
            "tp1-recompute-selective-qwen3",
            "Qwen3ForCausalLM",
            1,
            recompute=dict(recompute_granularity="selective"),
        ),
    ]
    return cases


# A size that means something (issue #21): Qwen3-0.6B's shape at TP=2, 512-token sequences. Not in the default
# list (about 12 GiB and minutes per step on 2 cores): --cases tp2-qwen3-0.6b.
REAL_SHAPE = MemoryCase("tp2-qwen3-0.6b", "Qwen3ForCausalLM", 2, dict(tensor_model_parallel_size=2), seq_length=512,
                        micro_batch_size=1, num_microbatches=2, hf_overrides=QWEN3_0_6B_SHAPE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cases = {case.name: case for case in _cases()}
    default = list(cases)
    cases[REAL_SHAPE.name] = REAL_SHAPE
    parser.add_argument("--cases", nargs="+", choices=sorted(cases), default=default)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()

    from megatron_gkd import platform

    platform.setup("cpu")
    from megatron_gkd.testing.planner_memory import compare

    rows = []
    for name in args.cases:
        case = cases[name]
        rows += compare(case, case.measure())
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| case | rank | stage | measured MiB | predicted MiB | predicted / measured | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['case']} | {row['rank']} | {row['pp_rank']} | {row['measured_bytes'] / 2**20:.2f} | "
            f"{row['predicted_bytes'] / 2**20:.2f} | {row['ratio']:.3f} | {row['max_rss_bytes'] / 2**20:.0f} |"
        )
    worst = max(rows, key=lambda row: abs(row["ratio"] - 1))
    print(f"\nlargest deviation: {worst['case']} rank {worst['rank']}: {worst['ratio'] - 1:+.1%}")


if __name__ == "__main__":
    main()
