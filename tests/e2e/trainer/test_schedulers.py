"""End to end under torchrun (a TP=2 student, vLLM rollout, the teacher service the run starts): each
scheduler trains exactly the batches it samples, with the staleness it promises, in both rollout layouts
(colocated vLLM TP=2 on the training ranks; a rollout server process, also with a PP=2 student), and
20 on-policy steps bring the student closer to the teacher on held-out prompts."""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

STALENESS = {"one_step_off": [0, 1, 1, 1, 1], "two_step_off": [0, 1, 2, 2, 2]}


def _check_batches(out, num_steps):
    steps = harness.steps(out)
    assert [r["step"] for r in steps] == list(range(1, num_steps + 1))
    prompts = [tuple(r["prompts"]) for r in steps]
    assert len(set(prompts)) == num_steps  # no batch trained twice
    assert steps[-1]["data/batches_sampled"] == steps[-1]["data/batches_trained"] == num_steps
    return steps


def test_sync_trains_fresh_batches_and_the_kl_to_the_teacher_falls(sync_run, assets):
    out, log = sync_run
    steps = _check_batches(out, 20)
    assert all(r["train/staleness"] == 0 for r in steps)
    evals = [r for r in harness.metrics(out) if "eval/kl_to_teacher" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert evals[-1]["eval/kl_to_teacher"] < evals[0]["eval/kl_to_teacher"] - 0.05, evals
    assert "megatron-gkd summary" in log and (out / "hf" / "step_20" / "model.safetensors.index.json").exists()
    assert (out / "tensorboard").is_dir() and (out / "config.yaml").exists()
    assert not harness.leftover_processes(str(assets / "teacher")), "the teacher service outlived the run"


DISAGGREGATED = ["rollout.layout=disaggregated", "weight_sync.transport=distributed", "rollout.tensor_parallel_size=1"]
LAYOUTS = {"colocated": [], "disaggregated": DISAGGREGATED,
           "disaggregated_pp2": DISAGGREGATED + ["parallel.tensor_model_parallel_size=1",
                                                 "parallel.pipeline_model_parallel_size=2"]}


# Suite time: two_step_off (a second batch in flight, the same code path) runs in the slow tier, and so does
# one_step_off colocated: the README's run command (the demo's config) runs that layout and scheduler in the
# default tier (tests/e2e/test_readme_commands.py), and the disaggregated case checks the staleness of the same
# BatchPipeline.
@pytest.mark.parametrize("scheduler, layout", [
    pytest.param("one_step_off", "colocated", marks=pytest.mark.slow),
    pytest.param("two_step_off", "colocated", marks=pytest.mark.slow),
    ("one_step_off", "disaggregated"), pytest.param("two_step_off", "disaggregated_pp2", marks=pytest.mark.slow)])
def test_off_policy_schedulers_keep_batches_in_flight(assets, tmp_path, scheduler, layout):
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + LAYOUTS[layout] + [
        f"trainer.scheduler={scheduler}", "trainer.num_steps=5", "eval.at_start=false", "eval.at_end=false",
        "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "checkpoint.save_interval=null"])
    assert code == 0, log[-4000:]
    steps = _check_batches(out, 5)
    assert [r["train/staleness"] for r in steps] == STALENESS[scheduler]
    if layout != "colocated":  # the server sampled while the ranks trained: only the first batch was waited for
        assert "rollout server stops after" in (out / "rollout_server.log").read_text()
