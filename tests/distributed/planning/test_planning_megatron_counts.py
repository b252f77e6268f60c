"""The planner's per-rank parameter counts equal those of real Megatron-Core builds of every architecture.

Each layout spawns its ranks once and builds all tiny architectures in them (``megatron_gkd.models``
with the local layer spec), so tensor, pipeline (tied output-layer copy on the last stage), virtual
pipeline and expert splits are all checked against what Megatron actually allocates.
"""

import pytest

from megatron_gkd.planning import Batch, StudentLayout, plan_student
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import TINY_CONFIGS
from megatron_gkd.testing.planner_memory import count_model_parameters, tiny_hf_config

pytestmark = pytest.mark.distributed

MOE = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")


def _count_all(architectures: list[str], sizes: dict) -> list[dict]:
    results = []
    for architecture in architectures:
        # Megatron-Core needs sequence parallelism for MoE layers under tensor parallelism.
        moe_tp = architecture in MOE and sizes.get("tensor_model_parallel_size", 1) > 1
        counts = count_model_parameters(tiny_hf_config(architecture), {**sizes, "sequence_parallel": moe_tp})
        results.append(dict(counts, arch=architecture))
    return results


LAYOUTS = [
    (2, dict(tensor_model_parallel_size=2), sorted(TINY_CONFIGS)),
    (2, dict(pipeline_model_parallel_size=2), sorted(TINY_CONFIGS)),
    pytest.param(2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                 ["Qwen2ForCausalLM", *MOE], marks=pytest.mark.slow),  # suite time
    (2, dict(expert_model_parallel_size=2), list(MOE)),
    pytest.param(4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), list(MOE), marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    "world_size, sizes, architectures", LAYOUTS, ids=["tp2", "pp2", "pp2-vpp2", "ep2", "tp2-ep2"]
)
def test_per_rank_counts_equal_megatron(world_size, sizes, architectures):
    results = run_distributed(_count_all, world_size, args=(architectures, sizes), timeout=600)
    tp = sizes.get("tensor_model_parallel_size", 1)
    for rank_results in results:
        for measured in rank_results:
            arch = measured["arch"]
            moe_tp = arch in MOE and tp > 1
            layout = StudentLayout.from_parallel_sizes({**sizes, "sequence_parallel": moe_tp}, world_size)
            planned = plan_student(tiny_hf_config(arch), layout, Batch(seq_length=16)).ranks[measured["pp_rank"]]
            assert (planned.parameters, planned.buffers) == (measured["parameters"], measured["buffers"]), (
                arch,
                sizes,
                measured,
            )
