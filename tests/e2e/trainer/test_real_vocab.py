"""The trainer on a real model's vocabulary shape (issue #21), slow tier: a tokenizer of 151,669 ids, a student
table of 151,936 rows and a teacher table of 152,064 (``megatron_gkd.recipes.real_vocab``), TP=2, on-policy
with the vllm rollout engine, the teacher's top-64; ``forward_kl`` and TCAD with the union support, each fused
and unfused.

What keeps the padding rows out, and how each is shown:
- never sampled: the rollout engine biases them away (``tests/e2e/rollout/test_padding_rows.py``); here the
  teacher refuses any id past its tokenizer's 151,669, so a run that finishes sampled none;
- never in a teacher top-k: the client drops teacher ids past the tokenizer and the loss refuses a valid id
  there (``prepare_teacher``), so a run that finishes trained on none;
- never given mass: the losses leave them out of the student's softmax (``real_vocab_size``; the padded
  cases of ``megatron_gkd.testing.losses`` against the dense float64 reference, TP 1/2/4).
Each run's loss falls over its steps, and its peak RSS per rank is set beside the planner's per-device
figure for the same config (printed; docs/scaling.md has the table): ``pytest tests/e2e/trainer/test_real_vocab.py
-m slow -s``.
"""

import json

import pytest

from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

COMMON = ["teacher.top_k=64", "trainer.num_steps=6", "trainer.scheduler=sync", "optim.lr=1e-2", "optim.lr_warmup_steps=0",
          "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null", "checkpoint.save_at_end=false",
          "checkpoint.hf_at_end=false"]
LOSSES = {
    "forward_kl": ["loss.type=forward_kl"],
    "tcad_union": ["loss.type=tcad", "loss.support_mode=union", "rollout.logprobs_k=8"],
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_gkd.recipes.real_vocab import build_assets

    return build_assets(tmp_path_factory.mktemp("real_vocab_assets"))


def _overrides(assets, loss: str, fused: bool) -> list[str]:
    return harness.asset_overrides(assets) + COMMON + LOSSES[loss] + [f"loss.fused={str(fused).lower()}"]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_real_vocabulary_trains_with_its_padding_rows_left_out(assets, tmp_path, loss, fused):
    from megatron_gkd.config import load_config
    from megatron_gkd.launcher.memory import student_plan

    out = tmp_path / "run"
    overrides = _overrides(assets, loss, fused)
    code, log = harness.run(out, overrides, timeout_s=1800)
    assert code == 0, log[-4000:]
    assert "vocabularies padded: teacher 152064 rows, student 151936 rows, tokenizer 151669 ids" in log
    losses = [row["train/loss"] for row in harness.steps(out)]
    assert len(losses) == 6
    assert sum(losses[-2:]) / 2 < losses[0], losses  # the loss falls
    summary = json.loads(log.split("megatron-gkd summary: ")[-1].splitlines()[0])
    config = load_config(harness.CONFIG, [f"trainer.output_dir={out}", *overrides])
    predicted = student_plan(config, world_size=2, kernels="local").ranks[0].memory.total / 2**30
    print(f"\n{loss} {'fused' if fused else 'unfused'}: losses {[round(x, 3) for x in losses]}; peak RSS per rank "
          f"{summary['peak_rss_gib_per_rank']} GiB; the planner's training memory per device {predicted:.3f} GiB")
    # The planner counts the trainer's tensors; RSS adds the libraries and the colocated vLLM engine on top.
    assert all(rss > predicted for rss in summary["peak_rss_gib_per_rank"])
