"""``trainer.token_budget``: a run stops after the step at which its trained response tokens reach the
budget, and a resumed run keeps counting from the checkpoint (equal-budget comparisons rely on both)."""

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e]

# SFT on the tiny assets' reference responses: one process, no teacher, no vLLM (eval off), so it is quick.
SFT = ["trainer.mode=sft", "rollout.n=1", "parallel.tensor_model_parallel_size=1", "rollout.tensor_parallel_size=1",
       "trainer.num_steps=40", "trainer.scheduler=sync", "eval.at_start=false", "eval.at_end=false",
       "checkpoint.save_interval=null", "checkpoint.hf_at_end=false"]


def _steps(out):
    return [r for r in harness.metrics(out) if "train/loss" in r]


def _assert_stops_at_the_budget(records, budget, first_total=0):
    totals, running = [], first_total
    for record in records:
        running += record["rollout/num_tokens"]
        totals.append(record["train/tokens_total"])
        assert record["train/tokens_total"] == running, "tokens_total is not the running sum of trained tokens"
    assert totals[-1] >= budget > totals[-2], f"stopped at {totals[-1]} tokens, budget {budget}: {totals}"


def test_token_budget_stops_the_run_and_survives_a_resume(assets, tmp_path):
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + SFT + ["trainer.token_budget=300"], nproc=1)
    assert code == 0, log[-4000:]
    first = _steps(out)
    assert len(first) < 40, "the budget did not stop the run before num_steps"
    _assert_stops_at_the_budget(first, 300)
    assert "token budget of 300 reached" in log

    # The same command with a larger budget resumes from the end-of-run checkpoint and counts on from it.
    code, log = harness.run(out, harness.asset_overrides(assets) + SFT + ["trainer.token_budget=700"], nproc=1,
                            log_name="resumed.log")
    assert code == 0, log[-4000:]
    assert f"resumed at step {first[-1]['step']}" in log
    resumed = [r for r in _steps(out) if r["step"] > first[-1]["step"]]
    assert resumed and resumed[0]["step"] == first[-1]["step"] + 1
    _assert_stops_at_the_budget(first[-1:] + resumed, 700, first_total=first[-1]["train/tokens_total"]
                                - first[-1]["rollout/num_tokens"])
