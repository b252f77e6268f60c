"""Predicted training memory per rank is within 25% of the peak measured on the CPU.

The peak is the largest sum of live tensor bytes during two Megatron-Core training steps, counted from
before the model is built (``LiveTensorPeak``: torch's profiler records every CPU allocation and
free), the host analogue of the accelerator allocator's ``max_memory_allocated``. ``benchmarks/planner_memory.py``
runs more layouts (sequence parallelism, VPP, recomputation, bf16, the distributed optimizer).
"""

import pytest

from megatron_gkd.testing.planner_memory import MemoryCase, compare

pytestmark = pytest.mark.distributed

TOLERANCE = 0.25

# Suite time: DeepSeek-V3 at EP=2 runs in the slow tier (benchmarks/planner_memory.py measures it too).
CASES = [
    MemoryCase("tp1-llama", "LlamaForCausalLM", 1),
    MemoryCase("tp2-qwen3", "Qwen3ForCausalLM", 2, dict(tensor_model_parallel_size=2)),
    MemoryCase("pp2-llama", "LlamaForCausalLM", 2, dict(pipeline_model_parallel_size=2)),
    MemoryCase("ep2-qwen3moe", "Qwen3MoeForCausalLM", 2, dict(expert_model_parallel_size=2)),
    MemoryCase("ep2-deepseekv3", "DeepseekV3ForCausalLM", 2, dict(expert_model_parallel_size=2)),
]


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case.name == "ep2-deepseekv3" else case
                                  for case in CASES], ids=[case.name for case in CASES])
def test_predicted_peak_within_tolerance(case):
    measured = case.measure()
    plan = case.plan()
    for row, result in zip(compare(case, measured), measured):
        rank = plan.ranks[result["pp_rank"]]
        assert rank.parameters == result["parameters"]
        assert abs(row["ratio"] - 1) <= TOLERANCE, row
        # The activation model carries weight here: without it the prediction would miss the peak.
        states_only = rank.memory.total - rank.memory.activations - rank.memory.backward_workspace
        assert states_only / result["peak_bytes"] < 1 - TOLERANCE, row
