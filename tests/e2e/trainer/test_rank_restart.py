"""A trainer rank that dies is restarted by torchrun (``--max-restarts``) and the run goes on from its last complete
checkpoint without a person (issue #48 item 3). A rank SIGKILLs itself as it starts step 4 (checkpoints every 2
steps: step 3 was trained and logged, not saved); torchrun stops the other and starts both again, which resume at step 2
and train steps 3-5. The run ends 0 and its metrics hold each step once, with the prompts, tokens and losses of a run
that never failed, equal to the bit: the restart loads the float32 state the checkpoint saved, the run is
deterministic and 2 data-parallel ranks sum in one order (the kill -9 resume test allows 1e-6 for its TP=2 vLLM run).
No teacher service of either attempt outlives the run.

Before the launcher put ``parallel.state.RESTART_ENV`` into torchrun's environment, the restarted attempt failed to
start: its rank 0 read the dead rank 1's gloo address from the store torchrun shares across attempts
(``Gloo connectFullMesh failed ... Connection refused``; pytorch/pytorch#135712). The trainer now refuses such a
restart setting at start-up (``tests/unit/parallel/test_restarts.py``)."""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# On-policy with the hf engine (no vLLM start-up), DP=2, deterministic, a checkpoint every 2 steps.
RUN = ["rollout.engine=hf", "rollout.tensor_parallel_size=1", "rollout.kv_cache_memory_mb=null",
       "parallel.tensor_model_parallel_size=1", "trainer.scheduler=sync", "trainer.num_steps=5",
       "trainer.deterministic=true", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "eval.at_start=false",
       "eval.at_end=false", "checkpoint.save_interval=2", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false",
       "optim.lr_warmup_steps=0", "optim.lr=2e-3"]
COMPARED = ("step", "prompts", "train/loss", "train/tokens_total", "data/batches_sampled", "data/epoch")


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The same run, never interrupted."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + RUN, log_name="reference.log")
    assert code == 0, log[-4000:]
    return harness.steps(out)


# Rank 1; rank 0 (slow tier twice over), which also holds the teacher service, the metrics writer and the ranks'
# store (RESTART_ENV makes trainer rank 0 host it).
@pytest.mark.slow  # two runs and a restart: about 2.5 minutes on 2 busy cores; the default tier has the unit checks
@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_restarts_the_run_from_its_last_checkpoint(assets, reference, tmp_path, rank):
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + RUN, module="tests.e2e.trainer.kill_rank",
                            max_restarts=1, env={"KILL_RANK": str(rank), "KILL_AFTER_STEP": "3"}, log_name="restarted.log")
    assert code == 0, log[-6000:]
    assert f"fault injection: SIGKILL to rank {rank} training step 4" in log, log[-6000:]
    assert log.count("resumed at step 2 ") == 1, log[-6000:]  # the restarted attempt, from iter_0000002
    assert harness.wait_until(lambda: not harness.leftover_processes(str(assets / "teacher")), 30), \
        "a teacher service outlived the run"

    got = harness.steps(out)
    # Step 3, trained by both attempts, is logged once (the restart drops the records after its checkpoint); the
    # data position and the tokens trained are the uninterrupted run's: no prompt skipped, repeated or counted twice.
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert [{key: r[key] for key in COMPARED} for r in got] == [{key: r[key] for key in COMPARED} for r in reference]
