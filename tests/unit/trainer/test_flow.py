""":class:`~megatron_gkd.trainer.flow.BatchFlow` in one process (a gloo world of 1, a fake rollout engine and teacher
client): a batch records which teacher scores each sample once, when its samples are made, and every later use reads
that record; ``prepare`` returns the micro-batches and the confidence metrics instead of leaving them on the flow."""

import concurrent.futures
import pathlib
import types

import numpy as np
import pytest
import torch

from megatron_gkd.config import load_config
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import TeacherOutput
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


def _flow(*overrides):
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
    flow = BatchFlow(config, state, control=None, dp_group=None, tokenizer=Tokenizer(), timers=Timers(),
                     teachers=teachers, rollout=Rollout(), stop_ids=(EOS,))
    return config, flow, calls


RECORDS = [Record(10 + i) for i in range(4)]


def test_the_teacher_assignment_is_made_once_per_batch():
    config, flow, calls = _flow()
    batch = flow.produce(0, RECORDS, {}, version=0)
    assert len(calls) == 1 and batch.assignment == {"teacher": list(range(len(batch.samples)))}
    prepared = flow.prepare(batch)
    flow.annotation_metrics(batch)
    assert len(calls) == 1  # the request, the colocated teachers' request in the update, the rows: one record
    assert len(prepared.microbatches) == len(batch.samples) // config.trainer.micro_batch_size
    scoring = flow.scoring_batch(batch.rollout, batch.prompt_indices, [None] * len(batch.prompt_indices))
    flow.prepare(scoring, scoring=True)
    assert len(calls) == 2  # a scoring batch records its own, once


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
        assert flow.annotation_metrics(batch)["rl/kd_coef"] == expected
        if combine == "loss":  # the divergence's coefficients: the token mean times the weight
            coefficients = torch.cat([mb.teachers[0].coefficients[mb.loss_mask] for mb in prepared.microbatches])
            assert float(coefficients.sum()) == pytest.approx(expected)
