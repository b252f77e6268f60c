"""The teacher cache through the real entry points: ``python -m megatron_gkd.teacher.cache build`` scores a
12-record dataset once through the served hf teacher; an off-policy run of 3 epochs from the cache (no teacher
started) has the losses of the same run against the live teacher, step by step; a build killed mid-write
resumes to the same bytes.

Equal to the bit: with ``data.shuffle=false`` and ``--batch-size 4`` the build sends the teacher the very
batches the live run sends (the hf teacher's float32 answers move with a batch's padded length)."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from megatron_gkd.teacher.cache.store import MANIFEST, PLAN, shard_name
from megatron_gkd.testing import runs as harness

# Each test starts a teacher service and runs the trainer (minutes on 2 shared cores): the unit tier
# (tests/unit/teacher/test_cache.py) covers the same points in-process in under a minute.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_RECORDS = 12
RUN = ["trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
       "trainer.num_steps=9", "data.shuffle=false", "eval.at_start=false", "eval.at_end=false",
       "checkpoint.save_interval=null", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false",
       "optim.lr_warmup_steps=0", "optim.lr=2e-3", "parallel.tensor_model_parallel_size=1", "teacher.temperature=1.5"]
SIGNALS = {"topk": [], "hidden": ["teacher.signal=hidden", "loss.type=jsd"]}


def _build_command(overrides, out):
    return [sys.executable, "-m", "megatron_gkd.teacher.cache", "build", "--config", str(harness.CONFIG), *overrides,
            "--out", str(out), "--batch-size", "4", "--records-per-shard", "4"]


def _start_build(overrides, out) -> subprocess.Popen:
    log = open(out.with_name(out.name + ".build.log"), "a")
    return subprocess.Popen(_build_command(overrides, out), cwd=harness.REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def _build(overrides, out) -> str:
    process = _start_build(overrides, out)
    code = process.wait(timeout=600)
    log = out.with_name(out.name + ".build.log").read_text()
    assert code == 0, log[-4000:]
    return log


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def small(assets, tmp_path_factory):
    """The first 12 records of the assets' training file: 3 steps of 4 prompts an epoch."""
    path = tmp_path_factory.mktemp("data") / "train12.jsonl"
    path.write_text("".join((assets / "train.jsonl").read_text().splitlines(keepends=True)[:NUM_RECORDS]))
    return path


def _overrides(assets, small, signal_name):
    return harness.asset_overrides(assets) + RUN + SIGNALS[signal_name] + [f"data.train_path={small}"]


def _cache_overrides(assets, small, signal_name, cache):
    return _overrides(assets, small, signal_name) + [
        "teacher.client=cache", f"teacher.cache_dir={cache}", "teacher.serve.model=null",
        f"teacher.checkpoint={assets / 'teacher'}"]


@pytest.fixture(scope="module")
def cache(assets, small, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "topk"
    _build(_overrides(assets, small, "topk"), out)
    return out


def _losses_live_and_cached(assets, small, signal_name, cache, tmp_path):
    live, cached = tmp_path / "live", tmp_path / "cached"
    code, log = harness.run(live, _overrides(assets, small, signal_name), nproc=1)
    assert code == 0, log[-4000:]
    code, log = harness.run(cached, _cache_overrides(assets, small, signal_name, cache), nproc=1)
    assert code == 0, log[-4000:]
    assert "matches this run" in log and "teacher service" not in log  # no teacher was started
    assert not (cached / "teacher_service.log").exists()
    return harness.steps(live), harness.steps(cached)


def test_three_epochs_from_the_cache_equal_the_live_teacher(assets, small, cache, tmp_path):
    manifest = (cache / MANIFEST).read_text()
    assert f'"num_records": {NUM_RECORDS}' in manifest  # one scoring pass: each record asked once
    live, cached = _losses_live_and_cached(assets, small, "topk", cache, tmp_path)
    assert len(live) == len(cached) == 9
    assert [r["prompts"] for r in cached] == [r["prompts"] for r in live]
    trained = [p for r in cached for p in r["prompts"]]
    assert sorted(trained) == sorted(list(range(NUM_RECORDS)) * 3)  # 3 epochs over every record
    assert live[0]["train/loss"] != live[-1]["train/loss"]
    assert [r["train/loss"] for r in cached] == [r["train/loss"] for r in live]
    assert [r["train/grad_norm"] for r in cached] == [r["train/grad_norm"] for r in live]


def test_hidden_signal_from_the_cache_equals_the_live_teacher(assets, small, tmp_path):
    cache = tmp_path / "hidden_cache"
    _build(_overrides(assets, small, "hidden"), cache)
    live, cached = _losses_live_and_cached(assets, small, "hidden", cache, tmp_path)
    assert len(live) == len(cached) == 9
    assert [r["train/loss"] for r in cached] == [r["train/loss"] for r in live]


# Sequence-level KD (#30): every response written by the teacher (lmbda 0), 2 a prompt, one epoch of 3 steps.
SEQ_KD = ["trainer.mode=on_policy", "sample_mix.lmbda=0", "sample_mix.source=teacher", "sample_mix.teacher.max_tokens=8",
          "rollout.n=2", "trainer.global_batch_size=8", "trainer.num_steps=3", "rollout.seed=7"]


def test_teacher_written_responses_from_the_cache_equal_the_live_teacher(assets, small, tmp_path):
    """A cache of teacher-written responses (the config's sample_mix.source=teacher decides the kind): the run from it
    trains on the responses and rows the live teacher gives the same run, step by step, with no teacher and no
    rollout engine started (the student never samples)."""
    cache = tmp_path / "written_cache"
    log = _build(_overrides(assets, small, "topk") + SEQ_KD, cache)
    assert '"generation"' in (cache / MANIFEST).read_text(), log[-2000:]
    live, cached = tmp_path / "live", tmp_path / "cached"
    code, log = harness.run(live, _overrides(assets, small, "topk") + SEQ_KD, nproc=1)
    assert code == 0, log[-4000:]
    code, log = harness.run(cached, _cache_overrides(assets, small, "topk", cache) + SEQ_KD, nproc=1)
    assert code == 0, log[-4000:]
    assert "teacher service" not in log and "vLLM" not in log  # neither a teacher nor a rollout engine
    live, cached = harness.steps(live), harness.steps(cached)
    assert len(live) == len(cached) == 3
    assert [r["mix/samples/teacher"] for r in cached] == [8.0] * 3 and [r["mix/student_fraction"] for r in cached] == [0.0] * 3
    for key in ("mix/tokens/teacher", "train/loss", "train/grad_norm"):
        assert [r[key] for r in cached] == [r[key] for r in live], key


def test_killed_build_resumes_to_the_same_bytes(assets, small, cache, tmp_path):
    out = tmp_path / "killed"
    # A slow teacher (1 s a request) gives the kill time to land between the first shard and the last.
    process = _start_build(_overrides(assets, small, "topk") + ["teacher.serve.delay_s=1.0"], out)
    try:
        assert harness.wait_until(lambda: (out / shard_name(0)).exists() or process.poll() is not None, 300)
        assert process.poll() is None, "the build ended before it could be killed"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert (out / PLAN).exists() and not (out / MANIFEST).exists()
    assert not (out / shard_name(2)).exists()
    log = _build(_overrides(assets, small, "topk"), out)
    assert "resuming the teacher cache build" in log
    assert _files(out) == _files(cache)


def test_a_cross_tokenizer_cache_equals_the_live_teacher_and_refuses_another_pair(assets, small, tmp_path):
    """A teacher of another tokenizer (the tiny teacher behind a permuted vocabulary, issue #29): the cache is built
    for the pair (the records' text in the teacher's own ids), trains exactly as the live teacher does, and a run
    whose teacher has another tokenizer is refused, naming the key."""
    from megatron_gkd.recipes.tiny import build_cross_teachers

    teachers = build_cross_teachers(assets, tmp_path / "cross_teachers")
    cross = [f"teacher.serve.model={teachers / 'permuted'}", "teacher.cross_tokenizer.method=projected"]
    cache = tmp_path / "cross_cache"
    _build(_overrides(assets, small, "topk") + cross, cache)
    manifest = (cache / MANIFEST).read_text()
    assert '"teacher_tokenizer_digest": "' in manifest  # built for a pair
    assert '"teacher_prompt": "text"' in manifest  # what the teacher read: the tiny permuted tokenizer has no template
    live, cached = tmp_path / "live", tmp_path / "cached"
    code, log = harness.run(live, _overrides(assets, small, "topk") + cross, nproc=1)
    assert code == 0, log[-4000:]
    from_cache = ["teacher.client=cache", f"teacher.cache_dir={cache}", "teacher.serve.model=null",
                  f"teacher.checkpoint={teachers / 'permuted'}", "teacher.cross_tokenizer.method=projected"]
    code, log = harness.run(cached, _overrides(assets, small, "topk") + from_cache, nproc=1)
    assert code == 0, log[-4000:]
    assert [r["train/loss"] for r in harness.steps(cached)] == [r["train/loss"] for r in harness.steps(live)]
    # Another teacher tokenizer for the same cache: refused before training, naming the field.
    other = from_cache + [f"teacher.cross_tokenizer.tokenizer={teachers / 'chars'}"]
    code, log = harness.run(tmp_path / "refused", _overrides(assets, small, "topk") + other, nproc=1)
    assert code != 0 and "teacher.cross_tokenizer.tokenizer" in log and "does not match this run" in log
    # And the same-tokenizer run on it: refused too (the cache holds teacher ids of another vocabulary).
    same = from_cache[:-1] + [f"teacher.checkpoint={assets / 'teacher'}"]
    code, log = harness.run(tmp_path / "refused_same", _overrides(assets, small, "topk") + same, nproc=1)
    assert code != 0 and "does not match this run" in log
