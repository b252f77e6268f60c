"""The hidden signal refuses an output layer that is not the served teacher's: ``teacher.head_checkpoint`` at a
model of the same shape with another seed passes every start-up check on shapes, so only numbers can tell. The run
compares the teacher's own log-prob of sampled tokens with ``hidden @ head`` on the first batch and stops before
training a step, naming the key. Through the real entry point: a served hf teacher, the trainer under torchrun."""

import pytest

from megatron_gkd.recipes.tiny import build_checkpoint
from megatron_gkd.testing import runs as harness

# Slow tier (suite time): tests/distributed/trainer/test_head_check_flow.py refuses the same head through the trainer's
# batch flow at TP=2 in the default tier, and tests/e2e/trainer/test_hidden_signal.py sees the right head pass.
pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

RUN = ["trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
       "trainer.num_steps=3", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
       "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0",
       "parallel.tensor_model_parallel_size=1", "teacher.signal=hidden", "loss.type=jsd"]


def test_a_head_of_another_model_of_the_same_shape_stops_the_run_before_a_step(assets, tmp_path):
    # The assets' teacher (recipes/tiny.py) with another seed: same config, other weights.
    other = build_checkpoint(tmp_path / "other_teacher", vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                             intermediate_size=512, seed=11)
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + RUN + [f"teacher.head_checkpoint={other}"],
                            nproc=1)
    assert code != 0, f"the run trained with another model's output layer: {log[-3000:]}"
    assert f"teacher.head_checkpoint={other}" in log and "nats" in log, log[-3000:]
    assert harness.steps(out) == []  # not one step trained
