"""A rollout server that dies mid-rollout is replaced, not fatal (issue #48 item 2; NeMo-RL's fault-tolerant
generation). Trainer rank 0 SIGKILLs the disaggregated vLLM server right after sending it a generate request
(``tests/e2e/trainer/kill_rollout_server.py``); the trainer ranks see the failure where they wait for the answer,
rank 0 starts a new server, the student's current weights go into it (verified), and the request is asked again.

Under ``sync`` the request is asked again with the weights it was first asked with and the same seed, so the new
server samples the same batch: every step's prompts, tokens and loss equal a run that never failed. Under
``one_step_off`` the killed request was being sampled while the ranks trained; it is asked again with the weights
of that moment (one step newer), so losses may differ from the uninterrupted run, but every batch is trained
exactly once, in order, and none is lost."""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

RUN = ["rollout.layout=disaggregated", "weight_sync.transport=distributed", "rollout.tensor_parallel_size=1",
       "trainer.num_steps=4", "rollout.seed=7", "trainer.deterministic=true", "eval.at_start=false",
       "eval.at_end=false", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false",
       "checkpoint.save_interval=null"]
COMPARED = ("step", "prompts", "train/loss", "train/tokens_total", "data/batches_sampled")


@pytest.mark.slow  # two runs with a vLLM server each, and a second server: about 4 minutes on 2 busy cores
@pytest.mark.parametrize("scheduler", ["sync", "one_step_off"])
def test_a_rollout_server_killed_mid_rollout_is_replaced_and_nothing_is_lost(assets, tmp_path, scheduler):
    overrides = harness.asset_overrides(assets) + RUN + [f"trainer.scheduler={scheduler}"]
    code, log = harness.run(tmp_path / "reference", overrides, log_name="reference.log")
    assert code == 0, log[-4000:]
    reference = harness.steps(tmp_path / "reference")

    out = tmp_path / "run"
    code, log = harness.run(out, overrides, module="tests.e2e.trainer.kill_rollout_server",
                            env={"KILL_AT_REQUEST": "3"}, log_name="killed.log")
    assert code == 0, log[-6000:]
    assert "fault injection: SIGKILL to the rollout server" in log and "sampling request 3" in log, log[-6000:]
    assert log.count("the rollout server died (exit code -9)") == 1, log[-6000:]
    assert (out / "rollout_server.1.log").exists() and "rollout server stops after" in (
        out / "rollout_server.1.log").read_text()

    got = harness.steps(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["rollout/server_restarts"] for r in got][-1] == 1
    if scheduler == "sync":  # the same batch sampled again by the new server: the uninterrupted run, to the bit
        assert [{key: r[key] for key in COMPARED} for r in got] == [{key: r[key] for key in COMPARED} for r in reference]
    else:  # the same prompts, each batch once, in order; the killed batch re-sampled with newer weights
        assert [r["prompts"] for r in got] == [r["prompts"] for r in reference]
        assert got[-1]["data/batches_sampled"] == reference[-1]["data/batches_sampled"]
    assert harness.wait_until(lambda: not harness.leftover_processes("megatron_gkd.rollout.server"), 30), \
        "a rollout server outlived the run"
