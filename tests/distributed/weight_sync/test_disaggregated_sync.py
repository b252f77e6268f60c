"""2 trainer ranks + 1 rollout rank (its own process, joined only by the weight-sync group).

The rollout rank records what vLLM's reload would be given (a stand-in; the e2e tests use vLLM): after
training steps and a sync, it holds exactly the tensors ``save_hf`` writes, bit for bit, and they
differ from the checkpoint the student started from. Small buckets force many buckets and tensors
larger than a bucket. Layouts: TP=2, PP=2, a Qwen3-MoE with EP=2, and DP=2
(only the first replica sends).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_gkd.testing.distributed import free_port, run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint, read_safetensors_dir
from megatron_gkd.testing.weight_sync import disaggregated
from megatron_gkd.weight_sync import WeightSyncConfig, WeightSyncPlan

pytestmark = pytest.mark.distributed

PROMPTS = [[3, 17, 42, 9, 100, 5], [7, 7, 250, 1]]


@pytest.fixture(scope="module", params=["direct", "packed"])
def synced(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"wsync-{request.param}")
    llama = make_tiny_checkpoint("LlamaForCausalLM", root / "llama", seed=3)
    moe = make_tiny_checkpoint("Qwen3MoeForCausalLM", root / "moe", seed=4)
    runs = [
        # Two rounds of training and sync: the second must replace what the first delivered (the
        # direct transfer's arena and the packed buffers are reused between syncs).
        dict(layout="tp2", path=llama, port=free_port(), steps=2, syncs=2),
        dict(layout="pp2", path=llama, port=free_port(), steps=2),
        dict(layout="ep2", path=moe, port=free_port(), steps=2),
        dict(layout="dp2", path=llama, port=free_port(), steps=2),
    ]
    # 48 KiB buckets: the 128 KiB embedding travels alone, the norms share buckets.
    config = WeightSyncConfig(bucket_size_mb=48 / 1024, transfer=request.param)
    results = run_distributed(
        disaggregated, 3, args=(runs, free_port(), 2, 1, config, PROMPTS, str(root)),
        kwargs=dict(use_vllm=False), init_process_group=False, timeout=600,
    )
    return runs, results


@pytest.mark.parametrize("index, layout", [(0, "tp2"), (1, "pp2"), (2, "ep2"), (3, "dp2")])
def test_rollout_receives_exactly_the_trained_weights(synced, index, layout):
    runs, (trainer0, trainer1, rollout) = synced
    sent, other, received = trainer0[index], trainer1[index], rollout[index]
    assert sent["layout"] == received["layout"] == layout
    assert sent["digest"] == other["digest"] == received["digest"]
    assert received["version"] == runs[index].get("syncs", 1) and received["num_buckets"] > 3
    saved, original = read_safetensors_dir(sent["saved"]), read_safetensors_dir(runs[index]["path"])
    assert sorted(received["weights"]) == sorted(saved) == sorted(original)
    changed = 0
    for name, tensor in saved.items():
        assert received["weights"][name].dtype == tensor.dtype
        assert torch.equal(received["weights"][name], tensor), f"{layout}: {name} differs from save_hf"
        changed += not torch.equal(tensor, original[name])
    # Adam moved every tensor with a gradient: a sync of stale weights would fail above.
    assert changed >= 0.9 * len(saved), f"{layout}: only {changed}/{len(saved)} tensors changed in training"


def test_plan_records_owner_stage_tp_dim_experts_and_transform(synced):
    _, (trainer0, _, _) = synced
    plans = {r["layout"]: WeightSyncPlan.from_json(r["plan"]) for r in trainer0}
    tp2 = {e.name: e for e in plans["tp2"].entries}
    q = tp2["model.layers.0.self_attn.q_proj.weight"]
    assert (q.tp_dim, q.tp_size, q.shape, q.part) == (0, 2, (128, 128), 0)
    assert q.fusion["type"] == "QKVFusion" and q.fusion["head_dim"] == 32
    assert tp2["model.layers.0.self_attn.o_proj.weight"].tp_dim == 1
    assert tp2["model.layers.0.mlp.up_proj.weight"].fusion == {"type": "Concat", "num_parts": 2, "dim": 0}
    assert tp2["model.norm.weight"].tp_dim is None
    assert {e.owner for e in plans["tp2"].entries} == {0, 1}  # the exporter spreads owners over TP ranks
    # Each TP rank sends its own slices; a replicated tensor comes from its owner alone.
    assert q.shards == (0, 1) and q.shard_shape == (64, 128)
    norm = tp2["model.norm.weight"]
    assert norm.shards == (norm.owner,)
    pp2 = {e.name: e for e in plans["pp2"].entries}
    assert (pp2["model.layers.0.mlp.down_proj.weight"].pp_rank, pp2["model.layers.0.mlp.down_proj.weight"].owner) == (0, 0)
    assert (pp2["model.layers.3.mlp.down_proj.weight"].pp_rank, pp2["model.layers.3.mlp.down_proj.weight"].owner) == (1, 1)
    assert pp2["lm_head.weight"].pp_rank == 1 and plans["pp2"].logits_rank == 1
    experts = [e for e in plans["ep2"].entries if e.expert is not None]
    assert sorted({e.expert for e in experts}) == [0, 1, 2, 3]
    assert all(e.owner == e.expert // 2 for e in experts)
    assert all(e.shards == (e.owner,) for e in experts)
    assert all(len(e.shards) == 1 for e in plans["pp2"].entries)
    # Data parallel: the first replica sends everything, the second nothing.
    assert plans["dp2"].senders == [0]
    assert all(json.loads(r["plan"]) for r in trainer0)
