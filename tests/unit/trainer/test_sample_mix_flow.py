"""GKD's mixture through :class:`~megatron_gkd.trainer.flow.BatchFlow` in one process (a gloo world of 1, a fake
rollout engine and teacher client): the student samples only its prompts, the teacher is asked for the others with
its own sampling settings, the batch holds both ordered by prompt, the teacher scores every response, and a failed
generate request stops the step naming it."""

import concurrent.futures
import dataclasses
import pathlib
import socket
import types

import numpy as np
import pytest
import torch.distributed as dist

from megatron_gkd.config import load_config
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import GeneratedSample, TeacherError, TeacherOutput
from megatron_gkd.trainer.flow import BatchFlow, batch_seed
from megatron_gkd.trainer.metrics import Timers
from megatron_gkd.trainer.sample_mix import draw_sources
from megatron_gkd.trainer.teachers import Teachers

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
EOS = 2


@pytest.fixture(scope="module", autouse=True)
def world():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@dataclasses.dataclass
class Record:
    index: int
    prompt_ids: list
    response_ids: list = dataclasses.field(default_factory=list)
    answer: str | None = None
    group: str | None = None


class Rollout:
    in_background = False

    def __init__(self):
        self.asked = []

    def generate(self, prompts, sampling):
        self.asked.append([list(p) for p in prompts])
        responses = [[100 + len(p), 101, EOS] for p in prompts for _ in range(sampling.n)]
        groups = [i // sampling.n for i in range(len(responses))]
        return RolloutBatch.from_samples(prompts=[prompts[g] for g in groups], responses=responses,
                                         logprobs=[[-0.5] * 3] * len(responses), group_ids=groups,
                                         finish_reasons=["stop"] * len(responses), weight_version=3)


class Client:
    """Writes ``[200 + prompt, 201]`` per sample and scores every token with log-prob -1."""

    num_retries = 0

    def __init__(self, error=None):
        self.generated, self.scored, self.error = [], [], error

    def generate(self, batch):
        self.generated.append(batch)
        if self.error is not None:
            raise self.error
        return [GeneratedSample(prompt_index=i, response_ids=np.array([200 + i, 201], dtype=np.int64))
                for i in range(len(batch.prompts)) for _ in range(batch.num_samples)]

    def score_async(self, batch):
        self.scored.append(batch)
        future = concurrent.futures.Future()
        future.set_result([TeacherOutput(topk_ids=np.zeros((len(s.response_ids), batch.top_k), dtype=np.int64),
                                         topk_logprobs=np.full((len(s.response_ids), batch.top_k), -1.0, np.float32),
                                         token_logprobs=np.full(len(s.response_ids), -1.0, np.float32))
                           for s in batch.sequences])
        return future


class Tokenizer:
    pad_token_id = 0

    def __len__(self):
        return 512


def _flow(overrides, client):
    config = load_config(BASE, ["sample_mix.lmbda=0.5", "sample_mix.per=prompt", *overrides])
    teachers = Teachers(config)
    teachers.by_name["teacher"].client = client
    state = types.SimpleNamespace(is_pipeline_last_stage=True, tp_rank=0, dp_rank=0, data_parallel_size=1,
                                  tp_group=None)
    tokenizer = Tokenizer()
    rollout = Rollout()
    flow = BatchFlow(config, state, control=None, dp_group=None, tokenizer=tokenizer, timers=Timers(),
                     teachers=teachers, rollout=rollout, stop_ids=(EOS,))
    return config, flow, rollout


RECORDS = [Record(index=10 + i, prompt_ids=[5 + i] * (1 + i), response_ids=[300 + i, EOS]) for i in range(4)]
TEACHER = ["sample_mix.source=teacher", "sample_mix.teacher.temperature=0.7", "sample_mix.teacher.top_p=0.9",
           "sample_mix.teacher.max_tokens=12"]


def test_student_prompts_are_sampled_and_the_others_written_by_the_teacher():
    client = Client()
    config, flow, rollout = _flow(TEACHER, client)
    sources = draw_sources(config.sample_mix, seed=config.trainer.seed, step=0, num_prompts=4)
    assert sorted(set(sources)) == ["student", "teacher"]  # a mixed batch
    batch = flow.produce(0, RECORDS, {}, version=3)
    assert batch.sources == sources
    student = [r.prompt_ids for r, source in zip(RECORDS, sources) if source == "student"]
    written = [r.prompt_ids for r, source in zip(RECORDS, sources) if source == "teacher"]
    assert rollout.asked == [student]
    [request] = client.generated  # the teacher's own settings, rollout.n samples a prompt, the run's stop ids
    assert [p.tolist() for p in request.prompts] == written
    assert (request.num_samples, request.temperature, request.top_p, request.max_tokens, request.stop_ids) == (
        config.rollout.n, 0.7, 0.9, 12, (EOS,))
    assert request.seed == batch_seed(config, 0)
    n = config.rollout.n
    rollout_batch = batch.rollout
    assert rollout_batch.group_ids.tolist() == [g for g in range(4) for _ in range(n)]
    for _i, sample in enumerate(batch.samples):
        record, source = RECORDS[sample.group], sources[sample.group]
        assert sample.source == source and sample.prompt_index == record.index
        assert sample.tokens[: sample.prompt_len].tolist() == record.prompt_ids
        expected = [100 + len(record.prompt_ids), 101, EOS] if source == "student" else [
            200 + written.index(record.prompt_ids), 201]
        assert sample.tokens[sample.prompt_len:].tolist() == expected
    # the teacher scores every response of both sources
    [score] = client.scored
    assert [s.token_ids.tolist() for s in score.sequences] == [s.tokens.tolist() for s in batch.samples]


def test_dataset_prompts_bring_their_records_response_once():
    client = Client()
    config, flow, rollout = _flow([], client)
    sources = draw_sources(config.sample_mix, seed=config.trainer.seed, step=1, num_prompts=4)
    batch = flow.produce(1, RECORDS, {}, version=3)
    assert client.generated == [] and len(rollout.asked) == (1 if "student" in sources else 0)
    dataset = [s for s in batch.samples if s.source == "dataset"]
    assert len(dataset) == sources.count("dataset")  # one response per record, whatever rollout.n
    for sample in dataset:
        assert sample.tokens[sample.prompt_len:].tolist() == RECORDS[sample.group].response_ids


def test_a_batch_without_student_prompts_samples_nothing():
    client = Client()
    config, flow, rollout = _flow([*TEACHER, "sample_mix.lmbda=0"], client)
    batch = flow.produce(0, RECORDS, {}, version=3)
    assert rollout.asked == [] and batch.sources == ["teacher"] * 4
    assert batch.rollout.num_samples == 4 * config.rollout.n and batch.rollout.weight_version == 3


def test_a_failed_generate_request_stops_the_step():
    client = Client(error=TeacherError("too_large", "more prompts than --max-generate-prompts"))
    _, flow, _ = _flow([*TEACHER, "sample_mix.lmbda=0"], client)
    with pytest.raises(TeacherError, match="max-generate-prompts"):
        flow.produce(0, RECORDS, {}, version=3)


@pytest.mark.parametrize("can_generate", [True, False])
def test_a_teacher_that_cannot_write_responses_is_refused_at_start_up(can_generate):
    from megatron_gkd.teacher.clients import TeacherInfo
    from megatron_gkd.trainer.components import teacher_check

    class Served(Client):
        def info(self):
            return TeacherInfo(vocab_size=512, tokenizer_size=512, tokenizer_digest="d", max_top_k=64,
                               supports_requested_ids=True, supports_temperature=True, supports_generate=can_generate)

        def align_vocab(self, tokenizer, vocab_size, cross_tokenizer=None):
            pass

    config, flow, _ = _flow(TEACHER, Served())
    check = teacher_check(config, Tokenizer(), 512, flow.exchange.tcad)
    teacher = flow.teachers.by_name["teacher"]
    if can_generate:
        check(teacher)
    else:
        with pytest.raises(ValueError, match="asks this teacher for responses, which it cannot write"):
            check(teacher)
    # without the teacher source nothing asks it to write
    config, flow, _ = _flow([], Served())
    teacher_check(config, Tokenizer(), 512, flow.exchange.tcad)(flow.teachers.by_name["teacher"])


def test_a_new_response_source_is_its_function_registered():
    """A new source of off-policy responses in one place (:mod:`megatron_gkd.rollout.sources`): a function of the
    records registered with its traits; the config accepts it, the mixture asks it for its prompts' responses, the
    batch holds them beside the student's samples and the teacher scores them, with no change to the flow."""
    from megatron_gkd.rollout.sources import RESPONSE_SOURCES, SourceTraits, generated_batch

    def echo(records, context):  # each prompt's ids backwards, rollout.n times, then EOS
        prompts = [list(record.prompt_ids) for record in records]
        responses = [prompt[::-1] + [EOS] for prompt in prompts for _ in range(context.num_samples)]
        return generated_batch(prompts, responses, context.num_samples, context.stop_ids, context.version,
                               context.pad_id)

    RESPONSE_SOURCES.register("echo", echo, traits=SourceTraits())
    try:
        client = Client()
        config, flow, rollout = _flow(["sample_mix.source=echo"], client)
        batch = flow.produce(0, RECORDS, {}, version=3)
    finally:
        RESPONSE_SOURCES.unregister("echo")
    sources = draw_sources(config.sample_mix, seed=config.trainer.seed, step=0, num_prompts=4)
    assert batch.sources == sources and sorted(set(sources)) == ["echo", "student"]
    assert rollout.asked == [[r.prompt_ids for r, source in zip(RECORDS, sources) if source == "student"]]
    assert client.generated == []  # the teacher writes nothing for this source
    echoed = [s for s in batch.samples if s.source == "echo"]
    assert len(echoed) == sources.count("echo") * config.rollout.n
    for sample in echoed:
        assert sample.tokens[sample.prompt_len:].tolist() == RECORDS[sample.group].prompt_ids[::-1] + [EOS]
    [score] = client.scored  # scored with the student's samples
    assert [s.token_ids.tolist() for s in score.sequences] == [s.tokens.tolist() for s in batch.samples]


def test_an_unknown_response_source_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"sample_mix.source='echo'; choose 'dataset' or 'teacher'"):
        load_config(BASE, ["sample_mix.lmbda=0.5", "sample_mix.source=echo"])
