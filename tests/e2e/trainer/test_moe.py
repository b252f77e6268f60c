"""A Qwen3-MoE student (random, 2 layers of 4 experts, top-2, load-balancing loss 0.01) through the real entry
point ``launch/pretrain_gkd.py``.

Layout invariance in ``off_policy`` mode (dataset responses scored by the teacher service each run starts, no
rollout engine): 3 steps at EP=2 (2 processes: the experts split over the two data-parallel ranks) and at
TP=2 x EP=2 with sequence parallelism (4 processes; ETP=2, Megatron's default, and ETP=1) give the losses, the
gradient norms, the load-balancing loss and the expert load of EP=1 (1 process) within 1e-5 (loads: exactly).

On-policy: the MoE student at EP=2 samples with a colocated vLLM TP=2 engine; after every step's weight sync
the engine's prompt log-probs equal the student's (``weight_sync.verify``: the sync fails otherwise), and the
run checkpoints and exports HF weights with every expert. ``tests/e2e/weight_sync/test_vllm_moe_sync.py``
compares each expert tensor in the engine with the trainer's.

Dynamic batching (``trainer.max_tokens_per_microbatch``) at EP=2 runs, its micro-batches evened out over the
data-parallel ranks; it equals EP=1 before the first update and within 1e-2 after (see the test).

Tiers: default: EP=1 against EP=2 and the MoE metrics (two runs, about 2 minutes on 2 quiet cores); slow: the
4-process layouts (about 3 minutes each), dynamic batching (two runs) and the on-policy vLLM run (about 4 minutes).
"""

import json

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

OFF_POLICY = harness.OFF_POLICY_3_STEPS
LAYOUTS = {
    "ep1": (1, ["parallel.tensor_model_parallel_size=1"]),
    "ep2": (2, ["parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2"]),
    # Megatron needs sequence parallelism for MoE layers under tensor parallelism.
    "tp2ep2": (4, ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                   "parallel.sequence_parallel=true"]),
    "tp2ep2etp1": (4, ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                       "parallel.expert_tensor_parallel_size=1", "parallel.sequence_parallel=true"]),
}
DYNAMIC = ["trainer.global_batch_size=8", "trainer.max_tokens_per_microbatch=40"]
LAYOUTS.update({f"{name}_dynamic": (LAYOUTS[name][0], LAYOUTS[name][1] + DYNAMIC) for name in ("ep1", "ep2")})
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_assets

    return build_assets(tmp_path_factory.mktemp("tiny_moe_assets"), moe=True)


@pytest.fixture(scope="module")
def layout_steps(moe_assets, tmp_path_factory):
    """``layout_steps(name)``: the step records of a 3-step off-policy run in that layout (each run once)."""
    found = {}

    def get(name):
        if name not in found:
            nproc, overrides = LAYOUTS[name]
            out = tmp_path_factory.mktemp(name) / "run"
            code, log = harness.run(out, harness.asset_overrides(moe_assets) + OFF_POLICY + overrides, nproc=nproc)
            assert code == 0, f"{name}: {log[-4000:]}"
            found[name] = harness.steps(out)
        return found[name]

    return get


def _moe_keys(record):
    return sorted(key for key in record if key.startswith("moe/"))


def _check_equal(reference, got, layout):
    assert len(reference) == len(got) == 3
    assert [r["prompts"] for r in got] == [r["prompts"] for r in reference]
    assert reference[0]["train/loss"] != reference[2]["train/loss"]  # the updates change the model
    for key in ("train/loss", "train/grad_norm", "moe/load_balancing_loss",
                *(f"moe/layer{layer}/load_balancing_loss" for layer in range(NUM_LAYERS))):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in reference], rel=1e-5, abs=1e-5), (layout, key)
    for key in _moe_keys(reference[0]):  # token counts: exactly (padding is left out of them)
        if "load_balancing" not in key:
            assert [r[key] for r in got] == [r[key] for r in reference], (layout, key)


@pytest.mark.slow  # suite time (an EP=1 run, 15 s): tests/distributed/trainer/test_policy_step.py checks EP=2 = one rank
def test_ep2_equals_ep1(layout_steps):
    _check_equal(layout_steps("ep1"), layout_steps("ep2"), "ep2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2ep2", "tp2ep2etp1"])
def test_tp2_ep2_equals_ep1(layout_steps, layout):
    _check_equal(layout_steps("ep1"), layout_steps(layout), layout)


@pytest.mark.slow
def test_dynamic_batching_at_ep2(layout_steps):
    """Token-budget micro-batches differ in number between data-parallel ranks; at EP=2 they are evened out
    (a rank with fewer would leave the other waiting in the token dispatcher's gather). The cuts then differ
    from EP=1's, and Megatron's load-balancing loss is a per-micro-batch quantity: its gradient, and so the
    later steps, differ by about the loss coefficient (0.01) times that, not 1e-5."""
    reference, got = layout_steps("ep1_dynamic"), layout_steps("ep2_dynamic")
    assert len(got) == 3 and [r["prompts"] for r in got] == [r["prompts"] for r in reference]
    assert got[0]["train/loss"] == pytest.approx(reference[0]["train/loss"], abs=1e-5)  # before any update
    assert [r["train/loss"] for r in got] == pytest.approx([r["train/loss"] for r in reference], abs=1e-2)
    assert [r["moe/tokens_routed"] for r in got] == [r["moe/tokens_routed"] for r in reference]


def test_moe_metrics_are_logged_every_step(layout_steps):
    for record in layout_steps("ep2"):
        keys = _moe_keys(record)
        for layer in range(NUM_LAYERS):
            for name in ("expert_load_max", "expert_load_min", "expert_load_imbalance", "load_balancing_loss"):
                assert f"moe/layer{layer}/{name}" in keys, (layer, name, keys)
            # top-2 of 4 experts: the loads add up to twice the tokens routed
            low, high = record[f"moe/layer{layer}/expert_load_min"], record[f"moe/layer{layer}/expert_load_max"]
            assert 0 <= low <= high <= record["moe/tokens_routed"]
            assert record[f"moe/layer{layer}/expert_load_imbalance"] == pytest.approx(high / (2 * record["moe/tokens_routed"] / 4))
        assert record["moe/dropped_tokens"] == 0  # no capacity factor: nothing is dropped
        # Switch-style loss: 1 when the router spreads evenly, up to num_experts / top-k when it does not.
        assert 0.9 < record["moe/load_balancing_loss"] < 2.0
        # Every sample's input is routed (prompt + response - 1 tokens each; padding is not counted).
        assert record["moe/tokens_routed"] >= record["train/num_loss_tokens"]


@pytest.mark.slow
def test_on_policy_with_vllm_rollout_and_expert_weight_sync(moe_assets, tmp_path):
    out = tmp_path / "run"
    overrides = harness.asset_overrides(moe_assets) + [
        "parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2", "trainer.num_steps=3",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "rollout.n=2", "rollout.max_tokens=12",
        "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null", "weight_sync.verify=true"]
    code, log = harness.run(out, overrides, nproc=2)
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    assert len(steps) == 3
    # one_step_off: the first two batches were sampled by version 0, the third by version 1 (synced after step 1).
    assert [r["train/weight_version"] for r in steps] == [0.0, 0.0, 1.0]
    assert all(r["rollout/num_tokens"] > 0 and "moe/load_balancing_loss" in r for r in steps)
    # The checkpoint and the HF export hold every expert of every layer.
    assert (out / "checkpoints" / "latest").exists() or any((out / "checkpoints").glob("iter_*"))
    index = json.loads((out / "hf" / "step_3" / "model.safetensors.index.json").read_text())["weight_map"]
    experts = {name for name in index if ".mlp.experts." in name}
    assert len(experts) == NUM_LAYERS * 4 * 3, sorted(experts)
