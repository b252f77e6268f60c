"""Real vLLM, MoE: a Qwen3-MoE trained at EP=2 (each rank holds 2 of 4 experts) syncs into a colocated vLLM
TP=2 shard on each rank (``external_launcher``); the colocated sync gathers the experts over EP.

Every expert tensor the engine holds is compared with the trainer's, gathered over EP straight from Megatron's
parameters: equal (bit for bit, after vLLM's own CPU repacking) after the sync, different before it (the
training moved them); the comparison itself is checked on the checkpoint vLLM started from. Prompt
log-probs after the sync equal the student's within 1e-4 (``verify=True`` checks it inside the sync as well).

Tier: slow (one 2-process run, about 1-2 minutes on 2 quiet cores; vLLM starts twice under load take longer).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint
from megatron_gkd.testing.weight_sync import colocated_moe_rank
from megatron_gkd.weight_sync import WeightSyncConfig

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

PROMPTS = [[3, 17, 42, 9, 100, 5, 61, 2], [7, 7, 250, 1, 99]]
CONFIG = WeightSyncConfig(transport="colocated", bucket_size_mb=0.25, verify=True, verify_prompts=tuple(map(tuple, PROMPTS)))
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    path = make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("moe") / "student", seed=5)
    return run_distributed(colocated_moe_rank, 2, args=(path, 3, CONFIG, PROMPTS), timeout=900, env=VLLM_ENV)


def test_every_expert_tensor_in_the_engine_equals_the_trainers(synced):
    for rank, result in enumerate(synced):
        assert result["num_experts"] == 4
        # The plan names every expert of every MoE layer (layer 1 is dense in the tiny config).
        assert len(result["expert_entries"]) == 3 * 4 * 3
        moe_layers = sorted(result["after"])
        assert moe_layers == [0, 2, 3], (rank, moe_layers)
        assert all(v["w13"] and v["w2"] for v in result["loaded"].values()), (rank, result["loaded"])
        assert not any(v["w13"] or v["w2"] for v in result["before"].values()), (rank, result["before"])
        assert all(v["w13"] and v["w2"] and v["max_error"] == 0 for v in result["after"].values()), (rank, result["after"])


def test_engine_log_probs_equal_the_students_after_the_sync(synced):
    result = synced[0]
    assert result["version"] == 1
    _, logprobs = result["outputs"]
    student = []
    for logits, prompt in zip(result["logits"], PROMPTS):
        values = torch.log_softmax(logits[:-1].double(), dim=-1)
        student.append(values.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0])
    error = (logprobs - torch.cat(student)).abs().max().item()
    assert error < 1e-4, error
