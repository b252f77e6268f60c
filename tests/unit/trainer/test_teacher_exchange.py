"""The teacher exchange in one process (a gloo world of 1, fake teacher clients that return known top-k rows): each
teacher is asked for the samples it scores and its rows come back in order, per-teacher metrics count what was asked,
and a failed teacher stops the step (named when there are several)."""

import concurrent.futures
import pathlib
import types

import numpy as np
import pytest
import torch

from megatron_gkd.config import load_config
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import TeacherError, TeacherOutput
from megatron_gkd.trainer.batch import samples_from_rollout
from megatron_gkd.trainer.metrics import Timers
from megatron_gkd.trainer.teacher_exchange import Scored, TeacherExchange, TeacherFailed
from megatron_gkd.trainer.teachers import Teachers

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
TWO = ["teacher.client=none", "teacher.serve.model=null",
       "teachers.add={client: zmq, top_k: 4, address: 'tcp://127.0.0.1:5601'}",
       "teachers.sub={client: zmq, top_k: 8, address: 'tcp://127.0.0.1:5602'}", "data.group_key=task"]


pytestmark = pytest.mark.usefixtures("gloo_world")  # conftest.py: a gloo world of one process


def expected_output(token_ids, response_start: int, top_k: int, offset: int) -> TeacherOutput:
    """Row ``t`` of a response: ids ``offset + token + j`` (``token``: the response's token ``t``), log-probs ``-(j + 1)
    - t / 100`` (descending), token log-prob ``-t / 10``."""
    response = np.asarray(token_ids[response_start:], dtype=np.int64)
    steps = np.arange(len(response))
    return TeacherOutput(topk_ids=offset + response[:, None] + np.arange(top_k)[None, :],
                         topk_logprobs=(-(np.arange(top_k)[None, :] + 1.0) - steps[:, None] / 100).astype(np.float32),
                         token_logprobs=(-steps / 10).astype(np.float32))


class Client:
    """Scores each sequence with :func:`expected_output` (``offset``: this teacher's), or fails with ``error``."""

    def __init__(self, offset: int = 0, error: Exception | None = None, num_retries: int = 0):
        self.offset, self.error, self.num_retries, self.scored = offset, error, num_retries, []

    def score_async(self, batch):
        self.scored.append(batch)
        future = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result([expected_output(s.token_ids, s.response_start, batch.top_k, self.offset)
                               for s in batch.sequences])
        return future


class Tokenizer:
    pad_token_id = 0

    def __len__(self):
        return 512


STATE = types.SimpleNamespace(is_pipeline_last_stage=True, tp_rank=0, dp_rank=0, data_parallel_size=1, tp_group=None)


def _exchange(overrides=(), **clients):
    config = load_config(BASE, list(overrides))
    teachers = Teachers(config)
    for name, client in clients.items():
        teachers.by_name[name].client = client
    return TeacherExchange(config, STATE, control=None, tokenizer=Tokenizer(), timers=Timers(), teachers=teachers)


def _samples(groups):
    """One sample per prompt, responses of 2, 3, 4, ... tokens; ``groups``: each prompt's ``data.group_key`` value."""
    prompts = [[5 + i] * (2 + i) for i in range(len(groups))]
    responses = [[100 + 10 * i + t for t in range(2 + i)] for i in range(len(groups))]
    batch = RolloutBatch.from_samples(prompts=prompts, responses=responses,
                                      logprobs=[[-0.5] * len(r) for r in responses], group_ids=list(range(len(groups))),
                                      finish_reasons=["stop"] * len(groups), weight_version=0)
    return samples_from_rollout(batch, range(len(groups)), [10 + i for i in range(len(groups))], list(groups))


def _expected_rows(samples, top_k: int, offset: int = 0):
    outputs = [expected_output(s.tokens.numpy(), s.prompt_len, top_k, offset) for s in samples]
    return (torch.from_numpy(np.concatenate([o.topk_ids for o in outputs])),
            torch.from_numpy(np.concatenate([o.topk_logprobs for o in outputs])),
            torch.from_numpy(np.concatenate([o.token_logprobs for o in outputs])))


def test_one_teacher_scores_every_sample_and_its_rows_come_back_in_order():
    client = Client()
    exchange = _exchange(teacher=client)
    samples = _samples([None, None, None])
    plan = exchange.assign(samples)
    assert plan == {"teacher": [0, 1, 2]}
    requests = exchange.request(samples, plan)
    [asked] = client.scored  # the samples' tokens, the response after the prompt, the teacher's top-k
    assert [s.token_ids.tolist() for s in asked.sequences] == [s.tokens.tolist() for s in samples]
    assert [s.response_start for s in asked.sequences] == [s.prompt_len for s in samples] and asked.top_k == 16
    rows = exchange.rows(samples, plan, exchange.outputs(requests))
    indices, found = rows["teacher"]
    ids, logprobs, tokens = _expected_rows(samples, 16)
    assert indices == [0, 1, 2] and found.hidden is None
    assert torch.equal(found.ids, ids) and torch.equal(found.logprobs, logprobs)
    assert torch.equal(found.token_logprobs, tokens)
    metrics = exchange.metrics(Scored(rows, requests), samples)
    assert metrics["teacher/tokens_scored"] == sum(s.response_len for s in samples) == 2 + 3 + 4
    assert metrics["teacher/retries"] == 0.0 and metrics["teacher/latency_s"] >= 0.0
    assert not any("/prompts" in key for key in metrics)  # the routing record is for several teachers


def test_routed_teachers_are_asked_for_their_samples_only():
    add, sub = Client(offset=0, num_retries=1), Client(offset=1000, num_retries=2)
    exchange = _exchange([*TWO, "teacher_mix.default=add"], add=add, sub=sub)
    samples = _samples(["sub", "add", "sub", None])
    plan = exchange.assign(samples)
    assert plan == {"add": [1, 3], "sub": [0, 2]}
    requests = exchange.request(samples, plan)
    assert [len(client.scored[0].sequences) for client in (add, sub)] == [2, 2]
    rows = exchange.rows(samples, plan, exchange.outputs(requests))
    for name, top_k, offset in (("add", 4, 0), ("sub", 8, 1000)):
        indices, found = rows[name]
        ids, logprobs, tokens = _expected_rows([samples[i] for i in plan[name]], top_k, offset)
        assert indices == plan[name] and torch.equal(found.ids, ids) and torch.equal(found.logprobs, logprobs)
        assert torch.equal(found.token_logprobs, tokens)
    metrics = exchange.metrics(Scored(rows, requests), samples)
    assert metrics["teacher/add/tokens_scored"] == 3 + 5 and metrics["teacher/sub/tokens_scored"] == 2 + 4
    assert metrics["teacher/add/retries"] == 1.0 and metrics["teacher/sub/retries"] == 2.0
    assert metrics["teacher/retries"] == 3.0
    assert metrics["teacher/add/prompts"] == [11, 13] and metrics["teacher/sub/prompts"] == [10, 12]


def test_a_teacher_without_samples_is_not_asked_and_gives_empty_rows():
    add, sub = Client(), Client()
    exchange = _exchange([*TWO, "teacher_mix.default=add"], add=add, sub=sub)
    samples = _samples(["add", None])
    plan = exchange.assign(samples)
    requests = exchange.request(samples, plan)
    assert list(requests) == ["add"] and sub.scored == []
    rows = exchange.rows(samples, plan, exchange.outputs(requests))
    indices, found = rows["sub"]
    assert indices == [] and found.ids.shape == (0, 8) and found.logprobs.shape == (0, 8)
    assert exchange.metrics(Scored(rows, requests), samples)["teacher/sub/tokens_scored"] == 0.0


def test_off_the_last_stage_there_are_no_rows():
    exchange = _exchange(teacher=Client())
    exchange.state = types.SimpleNamespace(**{**vars(STATE), "is_pipeline_last_stage": False})
    samples = _samples([None])
    assert exchange.rows(samples, exchange.assign(samples), {}) == {}


def test_a_failed_teacher_stops_the_step_naming_it_among_several():
    add, sub = Client(), Client(error=TeacherError("unavailable", "no answer in 30 s"))
    exchange = _exchange([*TWO, "teacher_mix.default=add"], add=add, sub=sub)
    samples = _samples(["add", "sub"])
    requests = exchange.request(samples, exchange.assign(samples))
    with pytest.raises(TeacherFailed, match=r"teacher 'sub' failed: TeacherError: .*no answer in 30 s") as caught:
        exchange.outputs(requests)
    assert caught.value.name == "sub"


def test_a_failed_single_teacher_raises_its_own_error():
    exchange = _exchange(teacher=Client(error=TeacherError("unavailable", "no answer in 30 s")))
    samples = _samples([None])
    requests = exchange.request(samples, exchange.assign(samples))
    with pytest.raises(TeacherError, match="no answer in 30 s"):
        exchange.outputs(requests)


def test_only_the_asked_kind_of_teacher_and_not_the_skipped_ones_are_asked():
    client = Client()
    exchange = _exchange(teacher=client)
    samples = _samples([None, None])
    plan = exchange.assign(samples)
    assert exchange.request(samples, plan, local=True) == {} and client.scored == []  # a remote teacher
    assert exchange.request(samples, plan, skip={"teacher"}) == {} and client.scored == []
    assert list(exchange.request(samples, plan, local=False)) == ["teacher"]


@pytest.mark.parametrize("colocated", [False, True])
def test_the_exchange_is_the_batch_s_first_annotator(colocated, tmp_path):
    """As an annotator (:mod:`megatron_gkd.trainer.annotations`): ``send`` records the assignment and asks the remote
    teacher; a colocated teacher (a collective of the training ranks) is asked in ``send`` when every rank made the
    samples together, and in ``receive`` when they were made on the rollout thread (``background``); ``receive``
    returns the rows, ``metrics`` reads what was asked."""
    overrides = ["teacher.client=local", f"teacher.checkpoint={tmp_path}", "teacher.serve.model=null"] if colocated \
        else []
    for background in (False, True):
        client = Client()
        exchange = _exchange(overrides, teacher=client)
        assert exchange.teachers.by_name["teacher"].local == colocated
        samples = _samples([None, None])
        asked = exchange.send(samples, {}, index=0, background=background)
        assert asked.assignment == {"teacher": [0, 1]} and asked.index == 0 and asked.samples is samples
        asked_now = not (colocated and background)
        assert len(client.scored) == int(asked_now) and sorted(asked.requests) == (["teacher"] if asked_now else [])
        scored = exchange.receive(asked)
        assert len(client.scored) == 1  # asked once, whichever call asked it
        indices, found = scored.rows["teacher"]
        ids, logprobs, tokens = _expected_rows(samples, 16)
        assert indices == [0, 1] and torch.equal(found.ids, ids) and torch.equal(found.token_logprobs, tokens)
        assert exchange.metrics(scored, samples)["teacher/tokens_scored"] == 2 + 3
