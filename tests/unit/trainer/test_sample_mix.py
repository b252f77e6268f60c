"""GKD's mixture in the batch path: each prompt's source drawn from (seed, step) alone (exact per seed, per batch or
per prompt, under every schedule), the off-policy parts merged into one batch ordered by prompt, and every source's
response tokens carried into the micro-batches' loss mask with their share of the step's loss."""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_gkd.config.sample_mix import SampleMixConfig
from megatron_gkd.rollout.sources import dataset_batch, generated_batch
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer.batch import build_microbatch, plan_microbatches, samples_from_rollout, token_coefficients
from megatron_gkd.trainer.sample_mix import (
    STUDENT,
    draw_sources,
    merge_by_prompt,
    sample_scores,
    source_metrics,
)


def _mix(**fields) -> SampleMixConfig:
    return SampleMixConfig(**{"lmbda": 0.5, **fields})


def test_the_draw_is_exact_per_seed_and_step():
    # Pinned: a change of the draw changes what resumed runs and recorded experiments trained on.
    per_prompt = _mix(per="prompt", source="teacher")
    assert [draw_sources(per_prompt, seed=1234, step=step, num_prompts=6) for step in range(2)] == [
        ["teacher", "student", "teacher", "student", "student", "student"],
        ["student", "student", "student", "teacher", "teacher", "teacher"]]
    assert [draw_sources(_mix(), seed=1234, step=step, num_prompts=2)[0] for step in range(6)] == [
        "dataset", "student", "dataset", "dataset", "student", "student"]


def test_a_resumed_run_draws_what_the_first_one_did_and_other_seeds_differ():
    mix = _mix(per="prompt")
    first = [draw_sources(mix, seed=7, step=step, num_prompts=8) for step in range(20)]
    np.random.seed(0)  # the global generators do not enter the draw
    torch.manual_seed(5)
    assert draw_sources(mix, seed=7, step=13, num_prompts=8) == first[13]  # drawn alone, as after a resume
    assert [draw_sources(mix, seed=8, step=step, num_prompts=8) for step in range(20)] != first


def test_per_batch_draws_one_source_for_the_whole_batch_with_probability_lmbda():
    mix = _mix(lmbda=0.3)
    batches = [draw_sources(mix, seed=3, step=step, num_prompts=5) for step in range(2000)]
    assert all(len(set(batch)) == 1 for batch in batches)
    share = sum(batch[0] == STUDENT for batch in batches) / len(batches)
    assert share == pytest.approx(0.3, abs=0.03)


def test_per_prompt_draws_each_prompt_on_its_own():
    mix = _mix(lmbda=0.25, per="prompt", source="teacher")
    batches = [draw_sources(mix, seed=3, step=step, num_prompts=16) for step in range(500)]
    assert sum(len(set(batch)) == 2 for batch in batches) > 400  # mixed batches
    share = sum(source == STUDENT for batch in batches for source in batch) / (16 * 500)
    assert share == pytest.approx(0.25, abs=0.02)
    assert {source for batch in batches for source in batch} == {"student", "teacher"}


@pytest.mark.parametrize("per", ["batch", "prompt"])
def test_lmbda_zero_and_one_are_exact_and_schedules_move_the_share(per):
    assert all(draw_sources(_mix(lmbda=1.0, per=per), seed=0, step=s, num_prompts=4) == [STUDENT] * 4
               for s in range(200))
    assert all(draw_sources(_mix(lmbda=0.0, per=per), seed=0, step=s, num_prompts=4) == ["dataset"] * 4
               for s in range(200))
    step = _mix(lmbda=0.0, per=per, schedule="step", milestones=[10], values=[1.0])
    assert [draw_sources(step, seed=0, step=s, num_prompts=3)[0] for s in (0, 9, 10, 50)] == [
        "dataset", "dataset", STUDENT, STUDENT]
    ramp = _mix(lmbda=0.0, per=per, schedule="linear", lmbda_end=1.0, ramp_steps=1000)
    early = sum(source == STUDENT for s in range(0, 200) for source in draw_sources(ramp, seed=0, step=s, num_prompts=4))
    late = sum(source == STUDENT for s in range(800, 1000) for source in draw_sources(ramp, seed=0, step=s, num_prompts=4))
    assert early < 250 < 550 < late  # expected 80 and 720 of 800


@dataclasses.dataclass
class _Record:
    prompt_ids: list
    response_ids: list


def _student(prompts, n, seed=0):
    rng = np.random.default_rng(seed)
    responses = [rng.integers(3, 50, int(rng.integers(1, 6))).tolist() for _ in range(len(prompts) * n)]
    groups = [i // n for i in range(len(responses))]
    return RolloutBatch.from_samples(prompts=[prompts[g] for g in groups], responses=responses,
                                     logprobs=[[-1.0] * len(r) for r in responses], group_ids=groups,
                                     finish_reasons=["stop"] * len(responses), weight_version=4,
                                     topk=[[[1, 2]] * len(r) for r in responses])


def _mixed_batch():
    """Six prompts: the student samples 0 and 3 (n=2), the teacher writes 1 and 5 (n=2), the dataset 2 and 4 (one each)."""
    prompts = [[10 + i, 11 + i, 12 + i][: 1 + i % 3] for i in range(6)]
    records = [_Record(prompts[i], [40 + i] * (2 + i)) for i in range(6)]
    sources = ["student", "teacher", "dataset", "student", "dataset", "teacher"]
    teacher = generated_batch([prompts[1], prompts[5]], [[7, 8, 2], [9], [5, 5, 5, 5], [6, 2]], 2, stop_ids=(2,),
                              version=0, pad_id=0)
    parts = [([1, 5], teacher), ([2, 4], dataset_batch([records[2], records[4]], 0, 0)), ([0, 3], _student(
        [prompts[0], prompts[3]], 2))]
    return prompts, records, sources, merge_by_prompt(parts, version=4, pad_id=0)


def test_merged_batch_is_ordered_by_prompt_with_each_sources_responses():
    prompts, records, sources, batch = _mixed_batch()
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 5, 5] and batch.weight_version == 4
    assert [batch.prompt(i) for i in range(batch.num_samples)] == [prompts[g] for g in batch.group_ids.tolist()]
    assert [batch.response(i) for i in (2, 3, 4, 7, 8, 9)] == [[7, 8, 2], [9], records[2].response_ids,
                                                               records[4].response_ids, [5, 5, 5, 5], [6, 2]]
    assert batch.finish_reasons[2:4] == ["stop", "length"]
    assert batch.topk(0).tolist()[0] == [1, 2] and (batch.topk(2) == -1).all()  # only the student has top-k ids
    assert batch.logprobs(0).tolist()[0] == -1.0 and batch.logprobs(2).tolist() == [0.0] * 3


def test_every_sources_tokens_reach_the_loss():
    prompts, _, sources, batch = _mixed_batch()
    samples = samples_from_rollout(batch, range(batch.num_samples), list(range(100, 106)), None, sources)
    assert [s.source for s in samples] == [sources[g] for g in batch.group_ids.tolist()]
    coefficients = token_coefficients(samples, total_tokens=batch.num_generated_tokens, num_groups=6)
    covered = {source: 0.0 for source in ("student", "teacher", "dataset")}
    tokens = dict.fromkeys(covered, 0)
    for indices in plan_microbatches([s.input_len for s in samples], micro_batch_size=3):
        chosen = [samples[i] for i in indices]
        microbatch = build_microbatch(chosen, [coefficients[i] for i in indices], labels=True)
        for row, sample in enumerate(chosen):
            start = sample.prompt_len - 1
            mask = microbatch.loss_mask[row]
            # the mask covers exactly the positions that predict the response, whatever its source
            assert mask.nonzero().flatten().tolist() == list(range(start, start + sample.response_len))
            assert microbatch.labels[row, mask].tolist() == sample.tokens[sample.prompt_len:].tolist()
            covered[sample.source] += float(microbatch.coefficients[row, mask].sum())
            tokens[sample.source] += sample.response_len
    total = batch.num_generated_tokens
    for source in covered:  # each source's share of the step's loss is its share of the response tokens
        assert tokens[source] > 0 and covered[source] == pytest.approx(tokens[source] / total)
    metrics = source_metrics(batch, sources, "teacher", lmbda=0.5)
    assert metrics["mix/samples/student"] == 4 and metrics["mix/samples/teacher"] == 4
    assert metrics["mix/student_fraction"] == 0.4 and metrics["mix/lmbda"] == 0.5
    assert metrics["mix/tokens/student"] == tokens["student"] and metrics["mix/tokens/teacher"] == tokens["teacher"]


def test_each_sources_part_of_the_loss_adds_up_to_the_step_loss():
    from megatron_gkd.trainer.metrics import mixture_loss_metrics
    from megatron_gkd.trainer.step import StepRunner

    _, _, sources, batch = _mixed_batch()
    samples = samples_from_rollout(batch, range(batch.num_samples), list(range(100, 106)), None, sources)
    coefficients = token_coefficients(samples, total_tokens=batch.num_generated_tokens, num_groups=6)
    generator = torch.Generator().manual_seed(0)
    totals, loss, divergences = {}, 0.0, {name: [] for name in ("student", "teacher", "dataset")}
    for indices in plan_microbatches([s.input_len for s in samples], micro_batch_size=4):
        chosen = [samples[i] for i in indices]
        microbatch = build_microbatch(chosen, [coefficients[i] for i in indices], sources=("student", "teacher", "dataset"))
        divergence = torch.rand(microbatch.shape, generator=generator, dtype=torch.float64)  # per-token loss
        weighted = divergence * microbatch.coefficients  # coefficients are 0 off the loss mask
        stats = {}
        StepRunner._source_stats(stats, microbatch, weighted)
        assert set(stats) == {f"mix/{kind}/{name}" for kind in ("loss", "weight") for name in divergences}
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + float(value)
        loss += float(weighted.sum())
        for name, where in microbatch.sources.items():
            divergences[name] += divergence[where].tolist()
    metrics = mixture_loss_metrics(totals)
    assert sum(metrics[f"mix/loss/{name}"] for name in divergences) == pytest.approx(loss)
    for name, values in divergences.items():  # the token mean: each source's mean divergence over its tokens
        assert metrics[f"mix/loss_per_token/{name}"] == pytest.approx(sum(values) / len(values))


def test_each_sources_accuracy_is_the_mean_score_of_its_own_samples():
    _, _, sources, batch = _mixed_batch()
    answers = [None] + [f"answer {g}" for g in range(1, len(sources))]  # the first prompt has no answer

    def score(prompt, response, answer):  # a scorer that accepts a response whose first id is odd
        assert answer == f"answer {answers.index(answer)}"
        return float(response[0] % 2)

    scores = sample_scores(batch, answers, score)
    expected = {}
    for i in range(batch.num_samples):
        group = int(batch.group_ids[i])
        assert (scores[i] is None) == (answers[group] is None)
        if answers[group] is not None:
            expected.setdefault(sources[group], []).append(float(batch.response(i)[0] % 2))
    metrics = source_metrics(batch, sources, "teacher", lmbda=0.5, scores=scores)
    assert {s: len(found) for s, found in expected.items()} == {"student": 2, "teacher": 4, "dataset": 2}
    assert set(expected["teacher"]) == {0.0, 1.0}
    for source in ("student", "teacher"):
        assert metrics[f"mix/accuracy/{source}"] == pytest.approx(sum(expected[source]) / len(expected[source]))
    assert sample_scores(batch, [None] * len(sources), score) is None
    assert not any(key.startswith("mix/accuracy") for key in source_metrics(batch, sources, "teacher", lmbda=0.5))
