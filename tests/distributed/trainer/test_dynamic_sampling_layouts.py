"""``rl.dynamic_sampling`` under torchrun: every layout keeps the same groups.

The real entry point trains three on-policy steps (the ``megatron`` rollout engine, a colocated teacher, a regex reward
that leaves about half the prompt groups with equal rewards, so batches refill) on one rank, then on two: each
data-parallel share computes the rewards of its half, every rank gathers them and drops the same groups, so the run
trains the same prompts, with the same rewards and losses, as one rank does. TP=2 (the rank without a reward worker
takes part in the gather with nothing) is in the slow tier.
"""

from __future__ import annotations

import pytest

from megatron_gkd.recipes.tiny import build_checkpoint, build_tokenizer, write_prompts
from megatron_gkd.testing import runs

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic_layouts")
    build_checkpoint(out / "student", vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                     intermediate_size=64, seed=2)
    build_tokenizer(out / "student", 64)
    write_prompts(out / "train.jsonl", 16, vocab_size=64, seed=3)
    return out


def trained(assets, out, nproc: int, tensor_parallel: int) -> list[tuple]:
    overrides = [
        f"student.checkpoint={assets / 'student'}", f"teacher.checkpoint={assets / 'student'}", "teacher.client=local",
        "teacher.serve.model=null", "teacher.top_k=4", f"data.train_path={assets / 'train.jsonl'}", "data.eval_path=null",
        "data.max_prompt_length=32", "eval.at_start=false", "eval.at_end=false", "trainer.mode=on_policy",
        "trainer.scheduler=sync", "trainer.num_steps=3", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
        f"parallel.tensor_model_parallel_size={tensor_parallel}", "rollout.engine=megatron", "rollout.tensor_parallel_size=1",
        "rollout.n=4", "rollout.max_tokens=4", "rollout.seed=3", "reward.kind=regex", r"reward.pattern='\bw[0-2]\b'",
        "rl.combine=loss", "rl.dynamic_sampling=true", "checkpoint.save_interval=null", "checkpoint.save_at_end=false",
        "checkpoint.hf_at_end=false", "logging.tensorboard=false"]
    code, log = runs.run(out, overrides, nproc=nproc, timeout_s=600)
    assert code == 0, log[-4000:]
    return [(record["prompts"], record["rl/dynamic_rounds"], record["rl/dynamic_groups_dropped"], record["reward/mean"],
             record["train/loss"]) for record in runs.steps(out)]


@pytest.fixture(scope="module")
def one_rank(assets, tmp_path_factory):
    return trained(assets, tmp_path_factory.mktemp("one_rank") / "run", nproc=1, tensor_parallel=1)


@pytest.mark.parametrize("tensor_parallel", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dp2", "tp2"])
def test_two_ranks_keep_the_groups_one_rank_keeps(assets, one_rank, tmp_path, tensor_parallel):
    assert sum(step[1] for step in one_rank) > len(one_rank)  # some batch refilled
    found = trained(assets, tmp_path / "run", nproc=2, tensor_parallel=tensor_parallel)
    assert [step[:4] for step in found] == [step[:4] for step in one_rank]
    assert [step[4] for step in found] == pytest.approx([step[4] for step in one_rank], abs=1e-6)
