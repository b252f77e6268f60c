""":class:`~megatron_gkd.trainer.flow.BatchFlow` in one process (a gloo world of 1, a fake rollout engine and teacher
client): a batch records which teacher scores each sample once, when its samples are made, and every later use reads
that record; ``prepare`` returns the micro-batches and the confidence metrics instead of leaving them on the flow."""

import concurrent.futures
import pathlib
import types
import unittest.mock

import numpy as np
import pytest
import torch

from megatron_gkd.config import load_config
from megatron_gkd.data import PromptSampler
from megatron_gkd.rewards import RewardFailed, RewardOutput
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import TeacherOutput
from megatron_gkd.trainer.components import build_reward_runner
from megatron_gkd.trainer.dynamic_sampling import next_draw, round_seed
from megatron_gkd.trainer.flow import BatchFlow, Prepared
from megatron_gkd.trainer.metrics import Timers
from megatron_gkd.trainer.teachers import Teachers

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
EOS = 2
RESPONSE = 3  # tokens of every sampled response


pytestmark = pytest.mark.usefixtures("gloo_world")  # conftest.py: a gloo world of one process


class Record:
    def __init__(self, index: int):
        self.index, self.prompt_ids, self.response_ids, self.answer, self.group = index, [5] * (1 + index % 3), [], None, None


class Rollout:
    in_background = False

    def generate(self, prompts, sampling):
        responses = [[100 + i, 101 + j, EOS] for i in range(len(prompts)) for j in range(sampling.n)]
        groups = [i // sampling.n for i in range(len(responses))]
        return RolloutBatch.from_samples(prompts=[prompts[g] for g in groups], responses=responses,
                                         logprobs=[[-0.5] * RESPONSE] * len(responses), group_ids=groups,
                                         finish_reasons=["stop"] * len(responses), weight_version=0)


class Client:
    """Scores response token ``t`` of every sequence with token log-prob ``-(t + 1) / 4``."""

    num_retries = 0

    def score_async(self, batch):
        future = concurrent.futures.Future()
        future.set_result([TeacherOutput(topk_ids=np.tile(np.arange(batch.top_k), (RESPONSE, 1)),
                                         topk_logprobs=np.tile(-np.arange(1.0, batch.top_k + 1, dtype=np.float32),
                                                               (RESPONSE, 1)),
                                         token_logprobs=-(np.arange(RESPONSE, dtype=np.float32) + 1) / 4)
                           for _ in batch.sequences])
        return future


class Tokenizer:
    pad_token_id = 0

    def __len__(self):
        return 512

    def decode(self, ids, **kwargs):  # the reward's verifier reads the response (no answer: reward 0)
        return " ".join(map(str, ids))


def _flow(*overrides, rollout=None, runner=None, annotators=()):
    """A flow over the fake engine and teacher (``rollout``: another fake engine; ``runner``: a fake reward runner in
    the reward worker's place)."""
    config = load_config(BASE, list(overrides))
    teachers = Teachers(config)
    teachers.by_name["teacher"].client = Client()
    calls = []
    assign = teachers.assign

    def counted(groups):
        calls.append(list(groups))
        return assign(groups)

    teachers.assign = counted
    state = types.SimpleNamespace(is_pipeline_last_stage=True, tp_rank=0, dp_rank=0, data_parallel_size=1,
                                  tp_group=None)
    with unittest.mock.patch("megatron_gkd.trainer.flow.build_reward_runner",
                             (lambda config, asks: runner) if runner is not None else build_reward_runner):
        flow = BatchFlow(config, state, control=None, dp_group=None, tokenizer=Tokenizer(), timers=Timers(),
                         teachers=teachers, rollout=rollout or Rollout(), stop_ids=(EOS,), annotators=annotators)
    return config, flow, calls


RECORDS = [Record(10 + i) for i in range(4)]


def test_the_teacher_assignment_is_made_once_per_batch():
    config, flow, calls = _flow()
    batch = flow.produce(0, RECORDS, {}, version=0)
    assert len(calls) == 1 and batch.sent["teacher"].assignment == {"teacher": list(range(len(batch.samples)))}
    prepared = flow.prepare(batch)
    assert len(calls) == 1  # the request, the colocated teachers' request in the update, the rows: one record
    assert len(prepared.microbatches) == len(batch.samples) // config.trainer.micro_batch_size
    scoring = flow.scoring_batch(batch.rollout, batch.prompt_indices, [None] * len(batch.prompt_indices))
    flow.prepare(scoring, scoring=True)
    assert len(calls) == 2  # a scoring batch records its own, once


class Lengths:
    """A new annotator in one class (:mod:`megatron_gkd.trainer.annotations`): each sample's response length, sent when
    the samples are made, received in the update, its mean logged."""

    name = "lengths"

    def __init__(self):
        self.sent, self.ready, self.closed = [], False, False

    def wait_ready(self):
        self.ready = True

    def send(self, samples, records, *, index, background=False):
        self.sent.append(sorted(records))
        future = concurrent.futures.Future()
        future.set_result([sample.response_len for sample in samples])
        return future

    def receive(self, handle):
        return handle.result()

    def metrics(self, value, samples):
        return {"lengths/mean": sum(value) / len(samples)}

    def close(self):
        self.closed = True


def test_a_new_annotator_is_its_class_passed_to_the_flow():
    lengths = Lengths()
    _, flow, _ = _flow(annotators=(lengths,))
    flow.annotations.wait_ready()
    batch = flow.produce(0, RECORDS, {}, version=0)
    assert lengths.ready and lengths.sent == [[r.index for r in RECORDS]] and batch.annotations == {}
    prepared = flow.prepare(batch)
    assert batch.annotations["rewards"] is None and batch.annotations["lengths"] == [RESPONSE] * len(batch.samples)
    assert list(batch.annotations) == ["teacher", "rewards", "lengths"]  # the teacher's rows first, then in order
    assert prepared.metrics["lengths/mean"] == RESPONSE
    flow.annotations.close()
    assert lengths.closed


def test_prepare_returns_the_confidence_metrics_instead_of_keeping_them():
    config, flow, _ = _flow("loss.confidence_alpha=1.0")
    prepared = flow.prepare(flow.produce(0, RECORDS, {}, version=0))
    assert isinstance(prepared, Prepared) and not hasattr(flow, "confidence")
    # Every response of the fake teacher scores alike: equal weights within each prompt group.
    assert prepared.confidence == pytest.approx({"train/confidence_weight_mean": 1 / config.rollout.n,
                                                 "train/confidence_weight_max": 1 / config.rollout.n,
                                                 "train/confidence_weight_entropy": float(np.log(config.rollout.n))})
    coefficients = torch.cat([mb.coefficients[mb.loss_mask] for mb in prepared.microbatches])
    assert float(coefficients.sum()) == pytest.approx(1.0)  # the step's loss is a weighted mean over the batch
    # The eval's scoring batches weigh no confidence; without confidence_alpha nothing is measured either.
    scoring = flow.scoring_batch(flow.produce(1, RECORDS, {}, version=0).rollout, [r.index for r in RECORDS],
                                 [None] * len(RECORDS))
    assert flow.prepare(scoring, scoring=True).confidence == {}
    _, plain, _ = _flow()
    assert plain.prepare(plain.produce(0, RECORDS, {}, version=0)).confidence == {}


@pytest.mark.parametrize("combine", ["teacher", "loss"])
def test_the_teacher_s_weight_follows_its_schedule_by_batch(combine):
    rewarded = ["reward.kind=final_answer"] if combine == "loss" else []
    config, flow, _ = _flow(f"rl.combine={combine}", *rewarded, "rl.kd_coef=2.0", "rl.kd_coef_end=0.5",
                            "rl.kd_coef_steps=3")
    records = [Record(10 + i) for i in range(4)]
    for record in records:
        record.answer = "7"
    for index, expected in ((0, 2.0), (1, 1.5), (5, 0.5)):
        batch = flow.produce(index, records, {}, version=index)
        prepared = flow.prepare(batch)
        assert {mb.policy.kd_coef for mb in prepared.microbatches} == {expected}
        assert prepared.metrics["rl/kd_coef"] == expected
        if combine == "loss":  # the divergence's coefficients: the token mean times the weight
            coefficients = torch.cat([mb.teachers[0].coefficients[mb.loss_mask] for mb in prepared.microbatches])
            assert float(coefficients.sum()) == pytest.approx(expected)


# ------------------------------------------------------------------------------------ DAPO's dynamic sampling
class GradedRollout:
    """Record ``i``'s prompt is ``[5, 10 + i]``; its samples hold token 7 (reward 1) all of them when ``i % 3 == 0``,
    none when ``i % 3 == 1``, every other one when ``i % 3 == 2``: only those groups' rewards differ. A sample's first
    token is its seed's (mod 50) and its log-probs its place in the group, so a kept sample shows where it came from."""

    in_background = False

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, sampling):
        self.seeds.append(sampling.seed)
        responses, logprobs, groups = [], [], []
        for group, prompt in enumerate(prompts):
            kind = (prompt[1] - 10) % 3
            for j in range(sampling.n):
                rewarded = kind == 0 or (kind == 2 and j % 2 == 0)
                responses.append([100 + sampling.seed % 50, 7 if rewarded else 8, EOS])
                logprobs.append([-(1 + j) / 8] * RESPONSE)
                groups.append(group)
        return RolloutBatch.from_samples(prompts=[prompts[g] for g in groups], responses=responses, logprobs=logprobs,
                                         group_ids=groups, finish_reasons=["stop"] * len(responses), weight_version=0)


class Runner:
    """The reward worker's place: 1.0 for a response that holds token 7, else 0.0."""

    def __init__(self):
        self.batches = []

    def submit(self, batch):
        self.batches.append(batch)
        future = concurrent.futures.Future()
        future.set_result(RewardOutput([float("7" in response.split()) for response in batch.responses], 0.0, 0.0))
        return future

    def close(self):
        pass


class GradedRecord(Record):
    def __init__(self, index: int):
        super().__init__(index)
        self.prompt_ids = [5, 10 + index]


DYNAMIC = ["rl.combine=loss", "reward.kind=regex", "reward.pattern=x", "rl.dynamic_sampling=true", "rollout.seed=40"]
DATASET = [GradedRecord(i) for i in range(12)]  # groups of records 2, 5, 8, 11 have rewards that differ


def _produce(flow, index: int, sampler: PromptSampler):
    def draw(count=None):  # as the trainer draws
        return [DATASET[position] for position in sampler.next_batch(count)]
    return flow.produce_batch(index, draw, sampler.state_dict(), version=0)


def _advantages(prepared) -> torch.Tensor:
    return torch.cat([mb.policy.advantages[mb.loss_mask] for mb in prepared.microbatches])


def test_dynamic_sampling_trains_only_groups_whose_rewards_differ_and_refills_the_batch():
    rollout, runner = GradedRollout(), Runner()
    config, flow, _ = _flow(*DYNAMIC, rollout=rollout, runner=runner)
    sampler = PromptSampler(len(DATASET), 4, shuffle=False, seed=0)
    batch = _produce(flow, 0, sampler)
    # Round 0 draws 0-3 (one informative group), round 1 draws 4 more (the shortfall of 3 over a fraction of 1/4,
    # at most a step's), round 2 the next 4: the first four informative groups in the order drawn.
    assert batch.prompt_indices == [2, 5, 8, 11] and sampler.state_dict()["position"] == 12
    assert rollout.seeds == [round_seed(40, r) for r in range(3)] and len(set(rollout.seeds)) == 3
    assert len(batch.samples) == config.trainer.global_batch_size
    for sample in batch.samples:  # each kept sample is its own round's, in its place in the group
        assert sample.tokens[:sample.prompt_len].tolist() == [5, 10 + sample.prompt_index]
        assert int(sample.tokens[sample.prompt_len]) == 100 + rollout.seeds[sample.prompt_index // 4] % 50
    prepared = flow.prepare(batch)
    assert len(runner.batches) == 3  # one reward call per round; the kept ones are not rewarded again
    rewards = [float(int(s.tokens[s.prompt_len + 1]) == 7) for s in batch.samples]
    assert batch.annotations["rewards"] == rewards and rewards == [1.0, 0.0] * 8  # the rewards follow their samples
    assert bool((_advantages(prepared) != 0).all())  # every trained group has a reward advantage
    metrics = prepared.metrics
    assert {k: v for k, v in metrics.items() if k.startswith("rl/dynamic")} == {
        "rl/dynamic_rounds": 3.0, "rl/dynamic_prompts_drawn": 12.0, "rl/dynamic_groups_dropped": 8.0,
        "rl/dynamic_groups_short": 0.0, "rl/dynamic_groups_surplus": 0.0, "rl/dynamic_informative_fraction": 1 / 3}
    assert metrics["reward/mean"] == 0.5 and metrics["reward/count"] == 16

    # Without it the step's first draw is the batch: three of its four groups carry no reward advantage.
    _, plain, _ = _flow(*DYNAMIC[:-2], "rollout.seed=40", rollout=GradedRollout(), runner=Runner())
    batch = _produce(plain, 0, PromptSampler(len(DATASET), 4, shuffle=False, seed=0))
    assert batch.prompt_indices == [0, 1, 2, 3] and batch.dynamic is None
    assert float((_advantages(plain.prepare(batch)) != 0).double().mean()) == 0.25


def test_dynamic_sampling_fills_with_equal_groups_when_its_rounds_run_out(caplog):
    _, flow, _ = _flow(*DYNAMIC, "rl.dynamic_sampling_max_rounds=1", rollout=GradedRollout(), runner=Runner())
    batch = _produce(flow, 3, PromptSampler(len(DATASET), 4, shuffle=False, seed=0))
    # Two rounds (0-3, 4-7) hold two informative groups; the first groups of equal rewards fill the batch.
    assert batch.prompt_indices == [2, 5, 0, 1]
    assert batch.dynamic["rl/dynamic_groups_short"] == 2.0 and batch.dynamic["rl/dynamic_groups_dropped"] == 4.0
    assert "batch 3: 2 of its 4 prompt groups have rewards that differ after 2 sampling rounds" in caplog.text
    advantages = [value for mb in flow.prepare(batch).microbatches for value in mb.policy.advantages[mb.loss_mask]]
    assert [bool(value != 0) for value in advantages[::RESPONSE]] == [True] * 8 + [False] * 8


def test_a_resumed_batch_draws_and_keeps_what_the_first_run_did():
    """The checkpoint's data position of a batch is the sampler's state before its first draw: a run resumed there
    draws the same rounds, samples them with the same seeds and trains the same groups, and ends where it did."""
    def run(start_state=None, start=0):
        rollout = GradedRollout()
        _, flow, _ = _flow(*DYNAMIC, rollout=rollout, runner=Runner())
        sampler = PromptSampler(len(DATASET), 4, shuffle=True, seed=5)
        if start_state is not None:
            sampler.load_state_dict(start_state)
        batches = []
        for index in range(start, 3):
            batches.append(_produce(flow, index, sampler))
        return batches, sampler.state_dict()

    batches, end = run()
    resumed, resumed_end = run(start_state=batches[1].data_state, start=1)
    assert resumed_end == end
    for first, again in zip(batches[1:], resumed):
        assert again.prompt_indices == first.prompt_indices and again.dynamic == first.dynamic
        assert torch.equal(again.rollout.response_ids, first.rollout.response_ids)
        assert torch.equal(again.rollout.rollout_logprobs, first.rollout.rollout_logprobs)
    assert len({tuple(b.prompt_indices) for b in batches}) == 3


def test_next_draw_asks_for_the_shortfall_over_the_informative_fraction():
    assert next_draw(8, informative=0, sampled=8) == 8  # none informative yet: a step's
    assert next_draw(8, informative=4, sampled=8) == 8  # 4 short at a half: 8
    assert next_draw(8, informative=6, sampled=8) == 3  # 2 short at 3/4: ceil(2.67)
    assert next_draw(8, informative=1, sampled=16) == 8  # capped at a step's


def test_a_round_whose_rewards_fail_fails_the_batch_s_update():
    """As a reward that fails in the update: the error reaches the update (where the trainer saves the last complete
    step with the failed batch's data position, tests/unit/trainer/test_loop.py), not the sampling that runs ahead."""
    runner = Runner()
    submit = runner.submit

    def failing(batch):  # the second round's rewards fail
        if len(runner.batches) == 1:
            future = concurrent.futures.Future()
            future.set_exception(RewardFailed("regex", "timed out"))
            runner.batches.append(batch)
            return future
        return submit(batch)

    runner.submit = failing
    _, flow, _ = _flow(*DYNAMIC, rollout=GradedRollout(), runner=runner)
    sampler = PromptSampler(len(DATASET), 4, shuffle=False, seed=0)
    batch = _produce(flow, 0, sampler)
    assert batch.data_state["position"] == 0  # where a resume starts this batch again
    with pytest.raises(RewardFailed, match="timed out"):
        flow.prepare(batch)


def _walk(run) -> list[str]:
    """The batch path's files (``trainer/``) that :mod:`megatron_gkd.trainer.flow` calls into while ``run()`` runs, in
    order, a file called again at once counted once (the phase timers of ``metrics.py`` left out: they time the walk;
    the config's answers, ``config.needs_teacher`` and the like, are not steps of it)."""
    import os
    import sys

    trainer = os.path.dirname(sys.modules[BatchFlow.__module__].__file__)
    flow_file = sys.modules[BatchFlow.__module__].__file__
    library = os.path.dirname(trainer)  # paths are named from it
    walk = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None or frame.f_back.f_code.co_filename != flow_file:
            return
        called = frame.f_code.co_filename
        if called.startswith(trainer) and called not in (flow_file, os.path.join(trainer, "metrics.py")):
            name = os.path.relpath(called, library)
            if not walk or walk[-1] != name:
                walk.append(name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return walk


@pytest.mark.parametrize("overrides", [[], ["reward.kind=final_answer", "rl.combine=loss"], ["sample_mix.lmbda=0.5"]],
                         ids=["distill", "rewards", "mixture"])
def test_the_walk_of_one_batch_enters_each_file_once_a_phase(overrides):
    """Issue #47's walk of one batch: from ``BatchFlow``, sampling (``produce``) and the update's preparation
    (``prepare``) each go through every file they call once, in order, and never return to one (docs/design.md, "One
    batch through one step"); the step's own walk is ``step.py`` then ``losses/terms.py``."""
    _, flow, _ = _flow(*overrides)
    records = [Record(10 + i) for i in range(4)]
    for record in records:
        record.answer, record.response_ids = "7", [300, 301, EOS]  # RESPONSE tokens, as the fake teacher scores
    made = []
    produce = _walk(lambda: made.append(flow.produce(0, records, {}, version=0)))
    prepare = _walk(lambda: flow.prepare(made[0]))
    for phase in (produce, prepare):
        assert len(phase) == len(set(phase)), f"the walk returns to a file: {phase}"
    assert produce[-2:] == ["trainer/batch.py", "trainer/annotations.py"]  # the teacher's requests among them
    assert prepare[0] == "trainer/annotations.py" and prepare[-1] == "trainer/microbatcher.py"
