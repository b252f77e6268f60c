"""A teacher cache of teacher-WRITTEN responses (sequence-level KD from files, issue #30 point 3), in one process: a
served hf teacher (proxy + worker on loopback, reached through the zmq client) writes 3 responses to each of the
tiny assets' 12 prompts; the cache then answers generate requests with the live teacher's very responses for the
same seeds and their scores bit for bit, picks fewer by seed, resumes an interrupted build to the same bytes, and
refuses requests and runs it cannot serve, naming the setting."""

import json
import pathlib

import numpy as np
import pytest

from megatron_gkd.config import load_config
from megatron_gkd.config.checks import teacher_response_limit
from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import stop_token_ids
from megatron_gkd.teacher import build_client
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.cache.__main__ import build
from megatron_gkd.teacher.cache.build import build_cache, make_plan
from megatron_gkd.teacher.cache.generated import (
    REBUILD_FLAG,
    SEED_STRIDE,
    generation_settings,
    pick_responses,
    prompt_records,
)
from megatron_gkd.teacher.cache.store import MANIFEST, PLAN, dataset_records
from megatron_gkd.teacher.clients.cache import CacheTeacherClient
from megatron_gkd.teacher.config import build_client_from_config
from megatron_gkd.teacher.protocol.types import ErrorCode, GenerateBatch, ScoreBatch, SequenceRequest, TeacherError
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.runs import CONFIG
from megatron_gkd.trainer.cache_check import check_cache_run

SECRET = b"generation-cache-test-secret-32b"
TOP_K, TEMPERATURE = 8, 1.5  # the scores' k and temperature (teacher.*)
NUM_PER_PROMPT = 3
PER_SHARD, PER_REQUEST, SEED = 5, 2, 7  # 12 prompts: shards of 5, 5, 2 prompts; 3, 3 and 1 requests
WRITING = ["sample_mix.teacher.temperature=1.2", "sample_mix.teacher.top_p=0.9", "sample_mix.teacher.top_k=50",
           "sample_mix.teacher.max_tokens=6"]
SEQ_KD = ["trainer.mode=on_policy", f"rollout.n={NUM_PER_PROMPT}", "trainer.global_batch_size=12",
          "trainer.micro_batch_size=3", "sample_mix.lmbda=0", "sample_mix.source=teacher", *WRITING]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_assets

    return build_assets(tmp_path_factory.mktemp("generation_assets"), num_train=12, num_eval=4)


@pytest.fixture(scope="module")
def teacher(assets):
    """The zmq client of a teacher service (proxy + hf worker of the assets' teacher) on loopback."""
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET).start()
    worker = Worker(proxy.backend_address, build_backend("hf", model=str(assets / "teacher")), secret=SECRET).start()
    client = build_client("zmq", address=proxy.frontend_address, secret=SECRET)
    yield client
    client.close()
    worker.close()
    proxy.close()


def _config(assets, *overrides, cache=None):
    """The seq-KD run on the assets: from ``cache`` when given (else the live teacher of the preset)."""
    served = [] if cache is None else ["teacher.client=cache", f"teacher.cache_dir={cache}", "teacher.serve.model=null",
                                       f"teacher.checkpoint={assets / 'teacher'}"]
    return load_config(CONFIG, [f"student.checkpoint={assets / 'student'}", f"data.train_path={assets / 'train.jsonl'}",
                                f"teacher.serve.model={assets / 'teacher'}", f"teacher.top_k={TOP_K}",
                                f"teacher.temperature={TEMPERATURE}", "eval.kl=false", *SEQ_KD, *served, *overrides])


@pytest.fixture(scope="module")
def tokenizer(assets):
    return load_tokenizer(str(assets / "student"))


@pytest.fixture(scope="module")
def prompts(assets, tokenizer):
    return prompt_records(load_prompts(str(assets / "train.jsonl"), DataConfig(), tokenizer))


def _generation(assets, tokenizer, num_per_prompt=NUM_PER_PROMPT):
    config = _config(assets)
    return generation_settings(config.sample_mix.teacher, teacher_response_limit(config),
                               stop_token_ids(config.rollout.stop_token_ids, tokenizer), num_per_prompt=num_per_prompt,
                               prompts_per_request=PER_REQUEST, seed=SEED)


def _build(teacher, assets, tokenizer, prompts, out, *, num_per_prompt=NUM_PER_PROMPT, on_shard=None, secret=SECRET):
    plan = make_plan(teacher.info(), {"client": "zmq", "model": str(assets / "teacher")},
                     teacher_checkpoint=str(assets / "teacher"), tokenizer=tokenizer, records=prompts,
                     data_path=str(assets / "train.jsonl"), top_k=TOP_K, temperature=TEMPERATURE, signal="topk",
                     hidden_dtype="bfloat16", records_per_shard=PER_SHARD,
                     generation=_generation(assets, tokenizer, num_per_prompt))
    return build_cache(teacher, prompts, out, plan, on_shard=on_shard, secret=secret)


@pytest.fixture(scope="module")
def cache_dir(teacher, assets, tokenizer, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("generation_cache")
    _build(teacher, assets, tokenizer, prompts, out)
    return out


@pytest.fixture(scope="module")
def cache(cache_dir):
    return CacheTeacherClient(str(cache_dir), secret=SECRET)


def _build_requests(prompts) -> list[list]:
    """The prompts of the build's requests in order: each shard's prompts, PER_REQUEST at a time."""
    shards = [prompts[start:start + PER_SHARD] for start in range(0, len(prompts), PER_SHARD)]
    return [shard[start:start + PER_REQUEST] for shard in shards for start in range(0, len(shard), PER_REQUEST)]


def _request(generation, prompts, number, **changes):
    """The build's request ``number`` (its prompts and seed), as the trainer would send it."""
    fields = dict(prompts=[p.token_ids for p in _build_requests(prompts)[number]],
                  num_samples=generation["num_per_prompt"], temperature=generation["temperature"],
                  top_p=generation["top_p"], top_k=generation["top_k"], max_tokens=generation["max_tokens"],
                  stop_ids=tuple(generation["stop_ids"]), seed=SEED + number * SEED_STRIDE)
    return GenerateBatch(**{**fields, **changes})


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


# ------------------------------------------------------------------------------------------ serving
def test_manifest_records_how_the_teacher_wrote(cache, prompts, assets, tokenizer):
    generation = cache.manifest.generation
    assert generation == _generation(assets, tokenizer)
    assert (generation["temperature"], generation["top_p"], generation["top_k"], generation["max_tokens"]) == \
        (1.2, 0.9, 50, 6)
    assert generation["stop_ids"] == [tokenizer.eos_token_id] and generation["seed"] == SEED
    assert cache.manifest.dataset["num_records"] == len(prompts) == 12  # the prompts
    assert sum(shard["num_records"] for shard in cache.manifest.shards) == 12 * NUM_PER_PROMPT
    assert cache.info().supports_generate


def test_generate_answers_equal_the_live_teachers_for_the_same_seed(cache, teacher, prompts):
    generation = cache.manifest.generation
    assert [len(r) for r in _build_requests(prompts)] == [2, 2, 1, 2, 2, 1, 2]
    for number in (0, 2, 3, 6):  # the first and last request of shard 0, shard 1's first, the short last shard's
        batch = _request(generation, prompts, number)
        live, cached = teacher.generate(batch), cache.generate(batch)
        assert len(cached) == batch.num_responses
        for want, have in zip(live, cached, strict=True):
            assert have.prompt_index == want.prompt_index
            assert have.response_ids.dtype == np.int64 and np.array_equal(have.response_ids, want.response_ids)


def test_scores_equal_the_live_teachers_bitwise(cache, teacher, prompts):
    generation = cache.manifest.generation
    batch = _request(generation, prompts, 1, score_top_k=TOP_K, score_temperature=TEMPERATURE)
    live, cached = teacher.generate(batch), cache.generate(batch)
    # The trainer's path: generate, then score prompt + response (found by the existing lookup).
    sequences = [s.sequence(batch.prompts[s.prompt_index]) for s in cached]
    scored = cache.score(ScoreBatch(sequences=sequences, top_k=TOP_K, temperature=TEMPERATURE))
    rescored = teacher.score(ScoreBatch(sequences=sequences, top_k=TOP_K, temperature=TEMPERATURE))
    for want, again, have, through_generate in zip(live, rescored, scored, cached, strict=True):
        for field in ("topk_ids", "topk_logprobs", "token_logprobs"):
            for other in (getattr(again, field), getattr(have, field), getattr(through_generate.output, field)):
                assert other.dtype == getattr(want.output, field).dtype
                assert np.array_equal(other, getattr(want.output, field)), field


def test_fewer_samples_are_picked_by_the_seed(cache, prompts):
    generation = cache.manifest.generation
    everything = cache.generate(_request(generation, prompts, 0))
    stored = [[s.response_ids for s in everything if s.prompt_index == i] for i in range(PER_REQUEST)]
    picks = {}
    for seed in (1, 2, 3, 4):
        batch = _request(generation, prompts, 0, num_samples=2, seed=seed)
        samples = cache.generate(batch)
        assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
        for index in range(PER_REQUEST):
            chosen = pick_responses(NUM_PER_PROMPT, 2, seed, index)
            assert len(set(chosen)) == 2
            for pick, sample in zip(chosen, samples[2 * index:2 * index + 2], strict=True):
                assert np.array_equal(sample.response_ids, stored[index][pick])
        picks[seed] = tuple(tuple(pick_responses(NUM_PER_PROMPT, 2, seed, i)) for i in range(PER_REQUEST))
        again = cache.generate(batch)
        assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(samples, again, strict=True))
    assert len(set(picks.values())) > 1  # the seed moves the choice
    no_seed = cache.generate(_request(generation, prompts, 0, num_samples=2, seed=None))
    assert [s.response_ids.tolist() for s in no_seed] == [r.tolist() for i in range(2) for r in stored[i][:2]]


@pytest.mark.parametrize("changes, message", [
    (dict(temperature=1.0, top_p=1.0), r"temperature: 1\.2 in the cache, 1\.0 asked; top_p: 0\.9 in the cache, 1\.0"),
    (dict(top_k=0), r"top_k: 50 in the cache, 0 asked"),
    (dict(max_tokens=7), r"max_tokens: 6 in the cache, 7 asked"),
    (dict(stop_ids=(3,)), r"stop_ids: \[\d+\] in the cache, \[3\] asked"),
    (dict(num_samples=4), rf"asks for 4 responses per prompt, the teacher cache .* holds 3; rebuild it with "
                          rf"{REBUILD_FLAG} 4"),
])
def test_requests_the_cache_cannot_answer_are_refused(cache, prompts, changes, message):
    with pytest.raises(TeacherError, match=message) as caught:
        cache.generate(_request(cache.manifest.generation, prompts, 0, **changes))
    assert caught.value.code == ErrorCode.BAD_REQUEST


def test_unknown_prompt_and_unknown_response_fail(cache, prompts):
    generation = cache.manifest.generation
    known = _request(generation, prompts, 0)
    other = GenerateBatch(prompts=[np.append(prompts[0].token_ids, 5)], num_samples=known.num_samples,
                          temperature=known.temperature, top_p=known.top_p, top_k=known.top_k,
                          max_tokens=known.max_tokens, stop_ids=known.stop_ids, seed=known.seed)
    with pytest.raises(TeacherError, match=r"prompt 0 of the request .* is not in the teacher cache .*"
                                           r"sample_mix\.source=teacher"):
        cache.generate(other)
    sample = cache.generate(_request(generation, prompts, 0))[0]
    changed = np.concatenate([prompts[0].token_ids, sample.response_ids[:-1], [5]])
    with pytest.raises(TeacherError, match="not in the teacher cache"):
        cache.score(ScoreBatch(sequences=[SequenceRequest(token_ids=changed, response_start=len(prompts[0].token_ids))],
                               top_k=TOP_K, temperature=TEMPERATURE))


# ------------------------------------------------------------------------------------------ building
class Interrupt(Exception):
    pass


def _stop_after(last):
    def stop(number):
        if number == last:
            raise Interrupt
    return stop


def test_interrupted_build_resumes_to_the_same_bytes(teacher, assets, tokenizer, prompts, cache_dir, tmp_path):
    with pytest.raises(Interrupt):
        _build(teacher, assets, tokenizer, prompts, tmp_path, on_shard=_stop_after(0))
    assert (tmp_path / PLAN).is_file() and not (tmp_path / MANIFEST).exists()
    _build(teacher, assets, tokenizer, prompts, tmp_path)
    assert _files(tmp_path) == _files(cache_dir)  # the signed manifest included


def test_resume_with_other_generation_settings_is_refused(teacher, assets, tokenizer, prompts, tmp_path):
    with pytest.raises(Interrupt):
        _build(teacher, assets, tokenizer, prompts, tmp_path, on_shard=_stop_after(0))
    with pytest.raises(ValueError, match=r"another build \(generation\.num_per_prompt: 3 there, 2 now\)"):
        _build(teacher, assets, tokenizer, prompts, tmp_path, num_per_prompt=2)


@pytest.mark.parametrize("overrides, message", [
    (["sample_mix.lmbda=0.5"], r"sample_mix\.lmbda=0\.5 \(schedule constant\) draws the student's own samples"),
    (["sample_mix.schedule=linear", "sample_mix.lmbda_end=0.5", "sample_mix.ramp_steps=2"],
     r"sample_mix\.lmbda=0\.0 \(schedule linear\) draws the student's own samples"),
    (["rollout.seed=null"], "set rollout.seed=N"),
])
def test_the_build_refuses_what_no_cache_can_serve(assets, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(_config(assets, *overrides), tmp_path, records_per_shard=4, batch_size=None, teacher_checkpoint=None)
    assert not any(tmp_path.iterdir())  # refused before any teacher was started


def test_responses_per_prompt_needs_teacher_written_responses(assets, tmp_path):
    with pytest.raises(ValueError, match=f"{REBUILD_FLAG} applies to a cache of teacher-written responses"):
        build(_config(assets, "sample_mix.lmbda=null", "trainer.mode=off_policy", "rollout.n=1"), tmp_path,
              records_per_shard=4, batch_size=None, teacher_checkpoint=None, responses_per_prompt=2)


# ------------------------------------------------------------------------------------------ the run's checks
def _check(assets, cache_dir, tokenizer, *overrides):
    config = _config(assets, *overrides, cache=cache_dir)
    client = build_client_from_config(config.teacher, SECRET)
    check_cache_run(client, config, tokenizer)
    return client


def test_the_sequence_kd_run_is_accepted(cache_dir, assets, tokenizer):
    _check(assets, cache_dir, tokenizer)
    _check(assets, cache_dir, tokenizer, "rollout.n=2", "trainer.global_batch_size=12")  # fewer than stored


@pytest.mark.parametrize("overrides, message", [
    (["sample_mix.teacher.temperature=1.0", "sample_mix.teacher.top_k=0"],
     r"sample_mix\.teacher\.temperature: 1\.2 in the cache, 1\.0 in this run; "
     r"sample_mix\.teacher\.top_k: 50 in the cache, 0 in this run"),
    (["sample_mix.teacher.top_p=1.0"], r"sample_mix\.teacher\.top_p: 0\.9 in the cache, 1\.0 in this run"),
    (["sample_mix.teacher.max_tokens=null"], r"sample_mix\.teacher\.max_tokens: 6 in the cache, 24 in this run"),
    (["rollout.stop_token_ids=[3]"], r"rollout\.stop_token_ids: \[\d+\] in the cache, \[\d+, 3\] in this run"),
    (["data.max_prompt_length=8"], r"data\.train_path: '[0-9a-f]{64}' in the cache"),
])
def test_a_run_that_differs_is_refused_naming_the_key(cache_dir, assets, tokenizer, overrides, message):
    with pytest.raises(ValueError, match=message) as caught:
        _check(assets, cache_dir, tokenizer, *overrides)
    assert "does not match this run" in str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.n=4", "trainer.global_batch_size=16"], rf"rollout\.n=4: .* holds 3 responses per prompt; rebuild it "
                                                      rf"with {REBUILD_FLAG} 4"),
    (["sample_mix.source=dataset"], "cannot score on-policy samples"),
    (["sample_mix.lmbda=null", "trainer.mode=off_policy", "rollout.n=1"],
     "holds responses the teacher wrote, which only a run with sample_mix.source=teacher"),
])
def test_runs_a_generation_cache_cannot_serve_are_refused(cache_dir, assets, tokenizer, overrides, message):
    with pytest.raises(ValueError, match=message):
        _check(assets, cache_dir, tokenizer, *overrides)


def test_a_run_mixing_in_student_samples_is_refused(cache, assets, tokenizer):
    # A config that names the cache is refused when loaded; the cache's own check refuses it as well.
    with pytest.raises(ValueError, match=r"sample_mix\.lmbda=0 at every step only"):
        _config(assets, "sample_mix.lmbda=0.5", cache=cache.reader.directory)
    with pytest.raises(ValueError, match=r"sample_mix\.lmbda=0\.5 \(schedule constant\) draws the student's own"):
        check_cache_run(cache, _config(assets, "sample_mix.lmbda=0.5"), tokenizer)


def test_a_cache_of_the_datasets_responses_cannot_write(teacher, assets, tokenizer, tmp_path):
    records = dataset_records(load_prompts(str(assets / "train.jsonl"), DataConfig(), tokenizer,
                                           require_responses=True))
    plan = make_plan(teacher.info(), {"client": "zmq", "model": str(assets / "teacher")},
                     teacher_checkpoint=str(assets / "teacher"), tokenizer=tokenizer, records=records,
                     data_path=str(assets / "train.jsonl"), top_k=TOP_K, temperature=TEMPERATURE, signal="topk",
                     hidden_dtype="bfloat16", records_per_shard=PER_SHARD)
    build_cache(teacher, records, tmp_path, plan)
    assert "generation" not in json.loads((tmp_path / MANIFEST).read_text())  # the manifest of before
    plain = CacheTeacherClient(str(tmp_path))
    assert teacher.info().supports_generate and not plain.info().supports_generate
    with pytest.raises(TeacherError, match="holds the dataset's own responses scored") as caught:
        plain.generate(GenerateBatch(prompts=[records[0].token_ids[:records[0].response_start]], seed=1))
    assert caught.value.code == ErrorCode.UNSUPPORTED
    with pytest.raises(ValueError, match="holds the dataset's own responses scored, and sample_mix.source=teacher"):
        check_cache_run(plain, _config(assets, cache=tmp_path), tokenizer)
