"""The teacher cache in one process: a real hf teacher (in-process, behind a counting client) scores the tiny
assets' records once; the cache then answers like the teacher did, for both signals, in any batching and for
3 epochs with no further scoring; an interrupted build resumes to the same bytes; damage and unknown
sequences fail loudly; a shard altered since the build wrote it is refused on resume; an edited manifest (with
the run's secret) and a cache that cannot be bound to a teacher are refused."""

import dataclasses
import json
import pathlib
import shutil
import threading

import numpy as np
import pytest
import torch

from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.cache.build import build_cache, make_plan
from megatron_gkd.teacher.cache.store import MANIFEST, PLAN, CacheReader, dataset_records, file_digest, shard_name
from megatron_gkd.teacher.clients import TeacherClient, TeacherInfo
from megatron_gkd.teacher.clients.cache import CacheTeacherClient
from megatron_gkd.teacher.protocol.security import SECRET_ENV
from megatron_gkd.teacher.protocol.types import HIDDEN_DTYPES, ScoreBatch, SequenceRequest, TeacherError
from megatron_gkd.trainer.cache_check import check_cache_run

TOP_K = 8
TEMPERATURE = 1.5
PER_SHARD = 7  # 24 records: 4 shards, the last one short


class BackendClient(TeacherClient):
    """An hf backend in this process, with what the wire does to hidden states (rounded to the requested dtype)
    and a count of the sequences it scored. One batch at a time, as a worker serves them: the backend's
    hidden-state hook is not for concurrent forwards."""

    def __init__(self, backend):
        super().__init__(max_inflight=2)
        self.backend, self.num_scored = backend, 0
        self._lock = threading.Lock()

    def info(self) -> TeacherInfo:
        info = self.backend.info()
        return TeacherInfo(**{field.name: getattr(info, field.name) for field in dataclasses.fields(TeacherInfo)})

    def _score(self, batch):
        with self._lock:
            self.num_scored += len(batch.sequences)
            outputs = self.backend.score(batch)
        if batch.is_hidden:
            dtype = getattr(torch, batch.hidden_dtype)
            outputs = [dataclasses.replace(o, hidden=torch.from_numpy(o.hidden).to(dtype).float().numpy())
                       for o in outputs]
        return outputs


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_assets

    return build_assets(tmp_path_factory.mktemp("cache_assets"), num_train=24, num_eval=4)


@pytest.fixture(scope="module")
def data(assets):
    from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer

    tokenizer = load_tokenizer(str(assets / "student"))
    dataset = load_prompts(str(assets / "train.jsonl"), DataConfig(), tokenizer, require_responses=True)
    return tokenizer, dataset_records(dataset)


@pytest.fixture(scope="module")
def teacher(assets):
    return BackendClient(build_backend("hf", model=str(assets / "teacher")))


def _plan(teacher, assets, data, signal="topk", hidden_dtype="bfloat16", checkpoint="teacher"):
    tokenizer, records = data
    return make_plan(teacher.info(), {"client": "test", "model": str(assets / checkpoint)},
                     teacher_checkpoint=str(assets / checkpoint), tokenizer=tokenizer, records=records,
                     data_path=str(assets / "train.jsonl"), top_k=TOP_K, temperature=TEMPERATURE, signal=signal,
                     hidden_dtype=hidden_dtype, records_per_shard=PER_SHARD)


def _build(teacher, assets, data, out, secret=None, on_shard=None, **plan):
    return build_cache(teacher, data[1], out, _plan(teacher, assets, data, **plan), batch_size=3, on_shard=on_shard,
                       secret=secret)


def _batch(records, signal="topk", hidden_dtype="bfloat16"):
    sequences = [SequenceRequest(token_ids=r.token_ids, response_start=r.response_start) for r in records]
    return ScoreBatch(sequences=sequences, top_k=TOP_K, temperature=TEMPERATURE, signal=signal, hidden_dtype=hidden_dtype)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("signal, hidden_dtype", [("topk", "bfloat16")] + [("hidden", d) for d in HIDDEN_DTYPES])
def test_cache_answers_what_the_teacher_answered(teacher, assets, data, tmp_path, signal, hidden_dtype):
    _build(teacher, assets, data, tmp_path, signal=signal, hidden_dtype=hidden_dtype)
    records = data[1]
    cache = CacheTeacherClient(str(tmp_path))
    fields = ("topk_ids", "topk_logprobs", "token_logprobs", "hidden")
    # The build's own first batch (3 records of shard 0): the teacher answers it again bit for bit.
    for expected, got in zip(teacher.score(_batch(records[:3], signal, hidden_dtype)),
                             cache.score(_batch(records[:3], signal, hidden_dtype)), strict=True):
        for field in fields:
            want, have = getattr(expected, field), getattr(got, field)
            assert (want is None and have is None) or (want.dtype == have.dtype and np.array_equal(want, have)), field
    # Other batchings and orders find the same rows (the lookup is by content). The hf teacher's own answers
    # move with a batch's padded length (float32 rounding), so these agree to rounding, not bits.
    for chunk in (records[10:15], records[::-5], records[7:8]):
        for expected, got in zip(teacher.score(_batch(chunk, signal, hidden_dtype)),
                                 cache.score(_batch(chunk, signal, hidden_dtype)), strict=True):
            np.testing.assert_array_equal(got.topk_ids, expected.topk_ids)
            np.testing.assert_allclose(got.topk_logprobs, expected.topk_logprobs, rtol=0, atol=1e-5)
            np.testing.assert_allclose(got.token_logprobs, expected.token_logprobs, rtol=0, atol=1e-5)
            if signal == "hidden":  # one rounding step of the wire dtype apart at most
                np.testing.assert_allclose(got.hidden, expected.hidden, rtol=2**-7, atol=1e-6)
    if signal == "hidden":
        stored = CacheReader(tmp_path)._handle(0).get_slice("hidden").get_dtype()
        assert stored == {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[hidden_dtype]


def test_three_epochs_score_each_record_once(teacher, assets, data, tmp_path):
    records = data[1]
    before = teacher.num_scored
    manifest = _build(teacher, assets, data, tmp_path)
    assert teacher.num_scored - before == len(records) == manifest.dataset["num_records"]
    cache = CacheTeacherClient(str(tmp_path))
    rng = np.random.default_rng(0)
    for _ in range(3):
        order = rng.permutation(len(records))
        for start in range(0, len(order), 4):
            cache.score_async(_batch([records[i] for i in order[start:start + 4]])).result()
    assert cache.num_scored == 3 * len(records)
    assert teacher.num_scored - before == len(records)  # the epochs asked nobody


class Interrupt(Exception):
    pass


def test_interrupted_build_resumes_to_the_same_bytes(teacher, assets, data, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _build(teacher, assets, data, whole)

    def die_after_second(number):
        if number == 1:
            raise Interrupt
    with pytest.raises(Interrupt):
        build_cache(teacher, data[1], broken, _plan(teacher, assets, data), batch_size=3, on_shard=die_after_second)
    assert (broken / PLAN).is_file() and not (broken / MANIFEST).exists()
    assert sorted(p.name for p in broken.glob("shard-*")) == [shard_name(0), shard_name(1)]
    with pytest.raises(ValueError, match="unfinished"):
        CacheTeacherClient(str(broken))
    (broken / f".{shard_name(2)}.tmp-999").write_bytes(b"half a shard")  # a write killed before its rename
    before = teacher.num_scored
    _build(teacher, assets, data, broken)
    assert teacher.num_scored - before == len(data[1]) - 2 * PER_SHARD  # the complete shards were kept
    assert _files(broken) == _files(whole)
    assert sorted(_files(whole)) == [MANIFEST] + [shard_name(n) for n in range(4)]


def test_resume_of_another_build_is_refused(teacher, assets, data, tmp_path):
    def stop(number):
        raise Interrupt
    with pytest.raises(Interrupt):
        build_cache(teacher, data[1], tmp_path, _plan(teacher, assets, data), batch_size=3, on_shard=stop)
    with pytest.raises(ValueError, match=r"another build \(.*signal: 'topk' there, 'hidden' now; top_k: 8 there"):
        _build(teacher, assets, data, tmp_path, signal="hidden")


def test_damaged_shard_and_unknown_sequence_fail(teacher, assets, data, tmp_path):
    _build(teacher, assets, data, tmp_path)
    records = data[1]
    unknown = dataclasses.replace(records[0], token_ids=np.append(records[0].token_ids, 5))
    with pytest.raises(TeacherError, match=r"not in the teacher cache .*\(trainer.mode=off_policy\)"):
        CacheTeacherClient(str(tmp_path)).score(_batch([records[1], unknown]))
    path = tmp_path / shard_name(0)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{shard_name(0)} has blake3 .* the cache is damaged"):
        CacheTeacherClient(str(tmp_path)).score(_batch(records[:1]))


# ------------------------------------------------------------------------------------------ refusals
@pytest.fixture(scope="module")
def caches(teacher, assets, data, tmp_path_factory):
    """A top-k cache and a bfloat16 hidden cache of the assets' records."""
    found = {}
    for signal in ("topk", "hidden"):
        out = tmp_path_factory.mktemp(f"cache_{signal}")
        _build(teacher, assets, data, out, signal=signal)
        found[signal] = out
    return found


def _run_config(assets, cache, *overrides):
    from megatron_gkd.config import load_config
    from megatron_gkd.testing.runs import CONFIG

    return load_config(CONFIG, [f"student.checkpoint={assets / 'student'}", f"data.train_path={assets / 'train.jsonl'}",
                                "teacher.client=cache", f"teacher.cache_dir={cache}", "teacher.serve.model=null",
                                f"teacher.checkpoint={assets / 'teacher'}", "trainer.mode=off_policy", "rollout.n=1",
                                f"teacher.top_k={TOP_K}", f"teacher.temperature={TEMPERATURE}", "eval.kl=false",
                                *overrides])


def _check(assets, cache, tokenizer, *overrides):
    """The run's own start-up: the client built from its teacher section (secret included), then checked."""
    from megatron_gkd.teacher.config import build_client_from_config

    config = _run_config(assets, cache, *overrides)
    client = build_client_from_config(config.teacher)
    check_cache_run(client, config, tokenizer)
    return client


@pytest.mark.parametrize("signal", ["topk", "hidden"])
def test_the_matching_run_is_accepted(caches, assets, data, signal):
    _check(assets, caches[signal], data[0], f"teacher.signal={signal}")


def _digest(directory):
    from megatron_gkd.teacher.cache import checkpoint_digest

    return checkpoint_digest(directory)


MISMATCHES = {
    # name: (cache, overrides, the message's field and values, as a regex)
    "top_k": ("topk", ["teacher.top_k=4"], r"teacher\.top_k: 8 in the cache, 4 in this run"),
    "temperature": ("topk", ["teacher.temperature=1.0"], r"teacher\.temperature: 1\.5 in the cache, 1\.0 in this run"),
    "signal": ("topk", ["teacher.signal=hidden"], r"teacher\.signal: 'topk' in the cache, 'hidden' in this run"),
    "hidden_dtype": ("hidden", ["teacher.signal=hidden", "teacher.hidden_dtype=float16"],
                     r"teacher\.hidden_dtype: 'bfloat16' in the cache, 'float16' in this run"),
    "teacher": ("topk", ["teacher.checkpoint={student}"], r"teacher\.checkpoint: '{teacher_digest}' in the cache, "
                                                          r"'{student_digest}' in this run"),
    "head": ("hidden", ["teacher.signal=hidden", "teacher.head_checkpoint={student}"],
             r"teacher\.head_checkpoint: '{teacher_digest}' in the cache, '{student_digest}' in this run"),
    "dataset": ("topk", ["data.train_path={eval}"], r"data\.train_path: '[0-9a-f]{{64}}' in the cache, "
                                                    r"'[0-9a-f]{{64}}' in this run"),
    "filtered": ("topk", ["data.max_response_length=4"], r"data\.train_path: '[0-9a-f]{{64}}' in the cache"),
}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_every_mismatch_is_refused_naming_it(caches, assets, data, name):
    signal, overrides, message = MISMATCHES[name]
    values = dict(student=assets / "student", eval=assets / "eval.jsonl", teacher_digest=_digest(assets / "teacher"),
                  student_digest=_digest(assets / "student"))
    with pytest.raises(ValueError, match=message.format(**values)) as caught:
        _check(assets, caches[signal], data[0], *[o.format(**values) for o in overrides])
    assert str(caches[signal]) in str(caught.value) and "does not match this run" in str(caught.value)


def test_another_tokenizer_is_refused(caches, assets, data, tmp_path):
    from megatron_gkd.recipes.tiny import build_tokenizer

    other = build_tokenizer(tmp_path, vocab_size=500)
    with pytest.raises(ValueError, match=r"tokenizer_digest: '[0-9a-f]{64}' in the cache, '[0-9a-f]{64}' in this run"):
        _check(assets, caches["topk"], other)


def test_a_pair_cache_scored_after_another_teacher_prompt_is_refused(caches, assets, data, tmp_path):
    """A cache built for a pair records what the teacher read before each response (issue #45): one whose teacher read
    the student's rendering (``text``) is refused by a run whose teacher reads its own chat template."""
    from megatron_gkd.data import load_tokenizer
    from megatron_gkd.data.tokenization import tokenizer_digest
    from megatron_gkd.recipes.tiny import CHAT_TEMPLATE, build_cross_teachers

    permuted = build_cross_teachers(assets, tmp_path / "cross", chat_template=CHAT_TEMPLATE) / "permuted"
    cache = tmp_path / "cache"
    shutil.copytree(caches["topk"], cache)
    manifest = json.loads((cache / MANIFEST).read_text())  # unsigned: the run binds it by teacher.checkpoint
    assert "teacher_prompt" not in manifest  # a same-tokenizer cache writes (and signs) what it did before
    manifest.update(teacher_tokenizer_digest=tokenizer_digest(load_tokenizer(str(permuted))), teacher_prompt="text")
    (cache / MANIFEST).write_text(json.dumps(manifest))
    cross = ["teacher.cross_tokenizer.method=projected", f"teacher.cross_tokenizer.tokenizer={permuted}"]
    with pytest.raises(ValueError, match=r"teacher\.cross_tokenizer\.prompt: 'text' in the cache, "
                                         r"'template:[0-9a-f]{16}' in this run"):
        _check(assets, cache, data[0], *cross)
    _check(assets, cache, data[0], *cross, "teacher.cross_tokenizer.prompt=text")  # the rule it was built with


@pytest.mark.parametrize("overrides, message", [
    (["trainer.mode=on_policy", "rollout.n=4"], "cannot score on-policy samples"),
    (["eval.kl=true"], "eval.kl scores the student's own eval answers"),
])
def test_runs_a_cache_cannot_serve_are_refused(caches, assets, data, overrides, message):
    with pytest.raises(ValueError, match=message):
        _check(assets, caches["topk"], data[0], *overrides)


def test_cache_dir_is_required_and_a_missing_cache_is_explained(tmp_path):
    from megatron_gkd.teacher.config import TeacherConfig, build_client_from_config

    with pytest.raises(ValueError, match="teacher.cache_dir is required for client 'cache'"):
        TeacherConfig(client="cache")
    with pytest.raises(ValueError, match="holds no manifest.json; build one with python -m megatron_gkd.teacher.cache"):
        build_client_from_config(TeacherConfig(client="cache", cache_dir=str(tmp_path)))


# ------------------------------------------------------------------------------------------ resuming (#33 item 4)
def _stop_after(last):
    def stop(number):
        if number == last:
            raise Interrupt
    return stop


def _swap_top2(path):
    """Swaps the teacher's two most likely ids in every row of a shard: same records, same size, wrong answers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["topk_ids"] = tensors["topk_ids"][:, [1, 0, *range(2, TOP_K)]].contiguous()
    size = path.stat().st_size
    save_file(tensors, str(path), metadata=metadata)
    assert path.stat().st_size == size


@pytest.fixture(scope="module")
def other_teacher(assets):
    """Another teacher with the same tokenizer: the student's checkpoint."""
    return BackendClient(build_backend("hf", model=str(assets / "student")))


def test_resume_refuses_a_shard_altered_since_it_was_written(teacher, assets, data, tmp_path):
    with pytest.raises(Interrupt):
        _build(teacher, assets, data, tmp_path, on_shard=_stop_after(1))
    _swap_top2(tmp_path / shard_name(0))
    with pytest.raises(ValueError, match=f"{shard_name(0)} has changed since this build wrote it"):
        _build(teacher, assets, data, tmp_path)
    assert not (tmp_path / MANIFEST).exists()


def test_resume_refuses_a_shard_copied_from_another_teachers_build(teacher, other_teacher, assets, data, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    with pytest.raises(Interrupt):
        _build(teacher, assets, data, ours, on_shard=_stop_after(1))
    with pytest.raises(Interrupt):
        _build(other_teacher, assets, data, theirs, on_shard=_stop_after(0), checkpoint="student")
    shutil.copyfile(theirs / shard_name(0), ours / shard_name(0))  # the same records, another teacher's answers
    with pytest.raises(ValueError, match=f"{shard_name(0)} has changed since this build wrote it"):
        _build(teacher, assets, data, ours)
    assert not (ours / MANIFEST).exists()


def test_a_shard_the_build_did_not_record_is_scored_again(teacher, assets, data, tmp_path):
    """A shard renamed into place whose hash the build had not recorded yet (killed in between) is not trusted."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _build(teacher, assets, data, whole)
    with pytest.raises(Interrupt):
        _build(teacher, assets, data, broken, on_shard=_stop_after(0))
    shutil.copyfile(whole / shard_name(1), broken / shard_name(1))  # on disk, not recorded
    before = teacher.num_scored
    _build(teacher, assets, data, broken)
    assert teacher.num_scored - before == len(data[1]) - PER_SHARD
    assert _files(broken) == _files(whole)


# ------------------------------------------------------------------------------------------ the manifest (#33 item 6)
SECRET = b"cache-test-secret-of-32-bytes..."


@pytest.fixture(scope="module")
def signed(teacher, assets, data, tmp_path_factory):
    """A top-k cache built with the run's secret (its manifest carries an HMAC)."""
    out = tmp_path_factory.mktemp("signed")
    _build(teacher, assets, data, out, secret=SECRET)
    return out


@pytest.mark.parametrize("case", ["same secret", "no secret", "other secret", "journal re-hashed"])
def test_a_signed_build_resumes_only_with_its_secret(teacher, signed, assets, data, tmp_path, case):
    with pytest.raises(Interrupt):
        _build(teacher, assets, data, tmp_path, secret=SECRET, on_shard=_stop_after(1))
    if case == "journal re-hashed":  # a shard altered and its recorded hash replaced, without the secret
        _swap_top2(tmp_path / shard_name(0))
        plan = json.loads((tmp_path / PLAN).read_text())
        plan["shards"][0]["blake3"] = file_digest(tmp_path / shard_name(0))
        (tmp_path / PLAN).write_text(json.dumps(plan))
    secret = {"no secret": None, "other secret": b"another-secret-of-some-length"}.get(case, SECRET)
    message = {"no secret": "started with the run's secret", "other secret": "its MAC does not verify",
               "journal re-hashed": "its MAC does not verify"}.get(case)
    if message is None:
        _build(teacher, assets, data, tmp_path, secret=SECRET)
        assert _files(tmp_path) == _files(signed)  # the MAC included: the same bytes as an uninterrupted build
    else:
        with pytest.raises(ValueError, match=message):
            _build(teacher, assets, data, tmp_path, secret=secret)


def _edited_copy(cache, destination, edit):
    shutil.copytree(cache, destination)
    path = destination / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest, destination)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return destination


def _secret_file(tmp_path, secret=SECRET):
    path = tmp_path / "secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return f"teacher.secret_file={path}"


def test_edited_temperature_is_refused_by_a_run_with_the_secret(signed, assets, data, tmp_path, monkeypatch):
    def to_one(manifest, _):
        manifest["temperature"] = 1.0
    cache = _edited_copy(signed, tmp_path / "cache", to_one)
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    with pytest.raises(ValueError, match="its MAC does not verify"):
        _check(assets, cache, data[0], "teacher.temperature=1.0")


def test_edited_shard_with_its_entry_rehashed_is_refused_by_a_run_with_the_secret(signed, assets, data, tmp_path):
    def swap_and_rehash(manifest, directory):
        _swap_top2(directory / shard_name(0))
        manifest["shards"][0]["blake3"] = file_digest(directory / shard_name(0))
    cache = _edited_copy(signed, tmp_path / "cache", swap_and_rehash)
    with pytest.raises(ValueError, match="its MAC does not verify"):
        _check(assets, cache, data[0], _secret_file(tmp_path)).score(_batch(data[1][:1]))


@pytest.fixture(scope="module")
def other_cache(other_teacher, assets, data, tmp_path_factory):
    """A complete cache of the same records by another teacher, without a secret."""
    out = tmp_path_factory.mktemp("other_cache")
    _build(other_teacher, assets, data, out, checkpoint="student")
    return out


def test_another_teachers_cache_without_teacher_checkpoint_is_refused(other_cache, assets, data, caplog):
    with pytest.raises(ValueError, match=r"cannot be bound to a teacher.*teacher\.checkpoint=DIR.*"
                                         r"teacher\.cache_trust_unverified=true"):
        _check(assets, other_cache, data[0], "teacher.checkpoint=null")
    # The explicit opt-out uses it, and says so.
    _check(assets, other_cache, data[0], "teacher.checkpoint=null", "teacher.cache_trust_unverified=true")
    assert "teacher.cache_trust_unverified=true" in caplog.text and str(assets / "student") in caplog.text


@pytest.mark.parametrize("case", ["unsigned", "other secret", "short secret", "no secret", "right secret"])
def test_the_secret_binds_a_cache_to_the_runs_builds(caches, signed, assets, data, tmp_path, case):
    """With a secret, a missing or foreign MAC is refused and a verified one binds the cache to a teacher (no
    teacher.checkpoint needed); without one, a signed cache is an unverified one."""
    cache, secret = {"unsigned": (caches["topk"], SECRET), "other secret": (signed, b"another-secret-of-some-length"),
                     "short secret": (signed, b"short"), "no secret": (signed, None),
                     "right secret": (signed, SECRET)}[case]
    overrides = ["teacher.checkpoint=null"] + ([_secret_file(tmp_path, secret)] if secret else [])
    message = {"unsigned": "carries no MAC", "other secret": "its MAC does not verify",
               "short secret": "MAC needs at least 16", "no secret": "cannot be bound to a teacher"}.get(case)
    if message is None:
        _check(assets, cache, data[0], *overrides).score(_batch(data[1][:3]))
    else:
        with pytest.raises(ValueError, match=message):
            _check(assets, cache, data[0], *overrides)
