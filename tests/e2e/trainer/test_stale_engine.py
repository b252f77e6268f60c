"""A rollout engine that stops taking weights stops the run, named, by default (issue #45 item 2).

The engine here (``tests/e2e/trainer/stale_engine.py``) reads every sync and keeps its first weights, as vLLM 0.32 did
with a tied head. Nothing else is changed: the tiny preset with the hf engine at DP=2, default check settings.

- ``sync`` scheduler, the per-step check alone (``weight_sync.check_interval=0``): step 1 trains on tokens the engine
  sampled claiming version 1; their log-probs are not the trainer's, and the run stops after that step with
  ``StaleRolloutEngine`` naming the figures, before any checkpoint of it.
- ``one_step_off`` (the presets' scheduler): every token is sampled one version behind the update, so the per-step
  comparison leaves them out; the periodic check verifies the first sync (and every tenth) and stops the run there.

A run with an honest engine logs ``engine/*`` and ``mismatch/*`` every step (tests/e2e/trainer/test_hf_rollout.py).
"""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# An engine with its own copy of the weights (rollout.release_weights=false): one that reads the student's in place
# (the hf engine's default) has no copy to keep stale, and one that skips a sync after a release refuses to sample.
HF_ENGINE = ["rollout.engine=hf", "rollout.release_weights=false", "rollout.tensor_parallel_size=1",
             "rollout.kv_cache_memory_mb=null",
             "parallel.tensor_model_parallel_size=1", "trainer.num_steps=4", "eval.at_start=false", "eval.at_end=false",
             "checkpoint.save_interval=1", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false",
             "optim.lr_warmup_steps=0"]


@pytest.mark.parametrize("scheduler, interval, stops", [
    ("sync", 0, "StaleRolloutEngine: at step 2, the rollout engine's log-probs of"),
    pytest.param("one_step_off", 10, "after weight sync to version 1, the rollout engine's prompt log-probs differ",
                 marks=pytest.mark.slow),  # suite time; the periodic check's arguments: tests/unit/trainer/test_rollout_handle.py
])
def test_an_engine_that_keeps_its_first_weights_stops_the_run_naming_it(assets, tmp_path, scheduler, interval, stops):
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + HF_ENGINE
                            + [f"trainer.scheduler={scheduler}", f"weight_sync.check_interval={interval}"],
                            module="tests.e2e.trainer.stale_engine")
    assert code != 0, log[-3000:]
    assert stops in log, log[-3000:]
    steps = harness.steps(out)
    if scheduler == "sync":  # step 1's batch was sampled with version 0, which the engine does hold
        assert [r["engine/mean_abs_error"] < 1e-3 for r in steps] == [True, False]
        saved = sorted(path.name for path in (out / "checkpoints").iterdir())
        assert "iter_0000001" in saved and "iter_0000002" not in saved, saved
