"""GKD's mixture in a run of the real entry point: the tiny preset (vLLM rollout, TP=2 student, one_step_off, served
hf teacher) with ``sample_mix.lmbda=0.5`` drawn per prompt and teacher-written responses. Each step trains on the
sources the seeded draw gives (mixed batches and one all-teacher batch), the teacher scores every response of both
sources, and every response token reaches the loss."""

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.testing import runs as harness
from megatron_gkd.trainer.sample_mix import draw_sources

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

SHORT = ["trainer.num_steps=3", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
         "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false"]
MIX = ["sample_mix.lmbda=0.5", "sample_mix.per=prompt", "sample_mix.source=teacher",
       "sample_mix.teacher.temperature=0.8", "sample_mix.teacher.max_tokens=16"]


def _teacher_mixture_steps(assets, tmp_path, *overrides) -> list[dict]:
    """A 3-step run with the teacher-written mixture; checks each step's sources and losses against the draw."""
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + SHORT + MIX + list(overrides))
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    config = load_config(out / "config.yaml")
    n = config.rollout.n
    for index, record in enumerate(steps):
        sources = draw_sources(config.sample_mix, seed=config.trainer.seed, step=index, num_prompts=4)
        students = sources.count("student")
        assert record["mix/samples/student"] == students * n and record["mix/samples/teacher"] == (4 - students) * n
        assert record["mix/student_fraction"] == students / 4 and record["mix/lmbda"] == 0.5
        # every response token of both sources is scored by the teacher and reaches the loss
        tokens = record["mix/tokens/student"] + record["mix/tokens/teacher"]
        assert tokens == record["rollout/num_tokens"] == record["train/num_loss_tokens"] == record["teacher/tokens_scored"]
        assert record["train/loss"] > 0
        # each source's part of the loss; they add up to the step's loss
        assert record["mix/loss/student"] + record["mix/loss/teacher"] == pytest.approx(record["train/loss"], rel=1e-5)
        for source in ("student", "teacher"):
            assert (record.get(f"mix/loss_per_token/{source}", 0.0) > 0) == (record[f"mix/tokens/{source}"] > 0)
            # the records carry answers: each source that brought samples has its samples' accuracy
            assert (f"mix/accuracy/{source}" in record) == (record[f"mix/samples/{source}"] > 0)
            assert 0.0 <= record.get(f"mix/accuracy/{source}", 0.0) <= 1.0
    return steps


def test_half_student_half_teacher_written_responses_per_prompt(assets, tmp_path):
    steps = _teacher_mixture_steps(assets, tmp_path)
    # the seeded draw gives two mixed batches and one written by the teacher alone (no rollout that step)
    assert [r["mix/student_fraction"] for r in steps] == [0.5, 0.75, 0.0]
    assert steps[2]["mix/tokens/teacher"] <= 16 * 16  # sample_mix.teacher.max_tokens per response
    # one_step_off: the teacher writes batch i + 1 before update i (the last batch is written before update 2)
    assert steps[0]["time/teacher_generate"] > 0 and steps[1]["time/teacher_generate"] > 0


def test_dataset_responses_mixed_per_prompt_over_two_vllm_replicas(assets, tmp_path):
    """The records' own responses (one per prompt) beside the student's ``rollout.n`` samples, with two colocated
    vLLM replicas: seed 1 draws one student prompt at step 0 (one replica samples nothing) and four at step 2."""
    from megatron_gkd.data import load_prompts, load_tokenizer
    from megatron_gkd.rewards.matching import exact_match

    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + SHORT + [
        "sample_mix.lmbda=0.5", "sample_mix.per=prompt", "sample_mix.seed=1", "rollout.tensor_parallel_size=1",
        "trainer.scheduler=sync"])
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    config = load_config(out / "config.yaml")
    tokenizer = load_tokenizer(config.student.tokenizer_path)
    records = {r.index: r for r in load_prompts(config.data.train_path, config.data, tokenizer, require_responses=True)}
    assert [r["mix/samples/student"] for r in steps] == [4.0, 8.0, 16.0]
    for index, record in enumerate(steps):
        sources = draw_sources(config.sample_mix, seed=1, step=index, num_prompts=4)
        dataset = [prompt for prompt, source in zip(record["prompts"], sources) if source == "dataset"]
        assert record["mix/samples/dataset"] == len(dataset)  # one response per record
        assert record["mix/tokens/dataset"] == sum(len(records[p].response_ids) for p in dataset)
        assert record["mix/tokens/student"] + record["mix/tokens/dataset"] == record["train/num_loss_tokens"]
        # the references scored against their answers (the prompt's first word) with eval.scorer (exact_match)
        texts = {p: tokenizer.decode(list(records[p].response_ids), skip_special_tokens=True) for p in dataset}
        expected = [exact_match(texts[p], records[p].answer) for p in dataset]
        assert record.get("mix/accuracy/dataset") == (sum(expected) / len(expected) if expected else None)


@pytest.mark.slow  # a vLLM rollout server: minutes
def test_teacher_written_responses_beside_a_rollout_server(assets, tmp_path):
    """The disaggregated layout: the student's part of a batch is sampled on the rollout thread and merged there with
    the teacher's responses asked for on the trainer ranks."""
    steps = _teacher_mixture_steps(assets, tmp_path, "rollout.layout=disaggregated", "weight_sync.transport=distributed",
                                   "rollout.tensor_parallel_size=1")
    assert [r["mix/student_fraction"] for r in steps] == [0.5, 0.75, 0.0]
