"""On-policy self-distillation with privileged context through the real entry point (issue #50 item 1): the tiny
student at TP=2 is its own teacher (``teacher.client=self``, no teacher model, no service), reading the record's
reference response before its prompt, top-16, forward KL; with the current weights, a frozen copy of the initial
ones, and an EMA of the student's weights.

The run finishes its steps with a finite loss that is not 0 (a teacher that read the student's own prompt with the
same weights would give a divergence of exactly 0 on every token), starts no teacher service and says how many
privileged prompts it learnt."""

import math
import re

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]  # about 50 s with its assets

OVERRIDES = ["teacher.client=self", "teacher.serve.model=null",
             'teacher.privileged_template="Reference solution: {response}\\n\\n{prompt}"',
             "trainer.scheduler=sync", "trainer.num_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
             "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null", "checkpoint.save_at_end=false",
             "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0"]


@pytest.mark.parametrize("weights", ["current", "initial", "ema"])
def test_the_student_distils_from_itself_reading_the_reference(assets, tmp_path, weights):
    out = tmp_path / "run"
    overrides = [o for o in harness.asset_overrides(assets) if not o.startswith("teacher.serve.model")] + OVERRIDES
    overrides.append(f"teacher.self_weights={weights}")
    code, log = harness.run(out, overrides)
    assert code == 0, log[-4000:]
    losses = [row["train/loss"] for row in harness.steps(out)]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 1e-4 for x in losses), losses
    assert not (out / "teacher_service.log").exists()
    learnt = re.search(r"self teacher: (\d+) privileged prompts learnt from (\d+) records \(raw text\)", log)
    assert learnt and int(learnt[1]) >= 256 and int(learnt[2]) >= 256, log[-4000:]  # train.jsonl's 256, eval's
    copies = re.findall(r"self teacher: a frozen copy of the initial weights \(.*\), ([0-9.]+) MiB on this rank", log)
    assert bool(copies) == (weights == "initial"), log[-4000:]  # the ranks' INFO lines: rank 0's at least
    averages = re.findall(r"self teacher: an EMA of the student's weights \(decay 0.99, .*\), ([0-9.]+) MiB on this rank",
                          log)
    assert bool(averages) == (weights == "ema"), log[-4000:]
