"""The trainer's handle on its rollout engine (trainer/rollout_handle.py) in one process (a gloo world of 1) with fake
engines: every request gets the run's stop ids, the colocated engine's batch reaches every rank, weights are synced
when the student samples (or when forced) and once per version, and a rollout server is asked through its thread."""

import concurrent.futures
import contextlib
import pathlib

import pytest
import torch.distributed as dist

from megatron_gkd.config import load_config
from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer.rollout_handle import Rollout

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"


pytestmark = pytest.mark.usefixtures("gloo_world")  # conftest.py: a gloo world of one process


def _batch(prompts, sampling, version: int) -> RolloutBatch:
    """``sampling.n`` responses per prompt, each the prompt's first id then 2 (the response ends with a stop id)."""
    rows = [(g, p) for g, p in enumerate(prompts) for _ in range(sampling.n)]
    return RolloutBatch.from_samples(prompts=[p for _, p in rows], responses=[[p[0], 2] for _, p in rows],
                                     logprobs=[[-0.5, -0.25] for _ in rows], group_ids=[g for g, _ in rows],
                                     finish_reasons=["stop"] * len(rows), weight_version=version)


class Engine:
    """A colocated engine that records what it was asked and loads nothing but the version."""

    def __init__(self, shares_student_weights: bool = True, releases_weights: bool = False):
        self.shares_student_weights, self.releases_weights = shares_student_weights, releases_weights
        self.asked, self.loads, self.closed, self.weight_version, self.releases = [], [], False, 0, 0

    def release_weights(self):
        self.releases += 1

    def generate(self, prompts, sampling):
        self.asked.append((prompts, sampling))
        return _batch(prompts, sampling, self.weight_version)

    def load_weights(self, named_tensors, version: int):
        self.loads.append((list(named_tensors), version))
        self.weight_version = version

    def close(self):
        self.closed = True


class Remote:
    """A rollout server's trainer side: generate, call (its thread, here run at once) and sync."""

    epoch = 0  # servers replaced so far

    def __init__(self):
        self.asked, self.syncs, self.checks, self.client = [], [], [], self

    def generate(self, prompts, sampling):
        self.asked.append((prompts, sampling))
        return _batch(prompts, sampling, version=len(self.syncs))

    def call(self, fn, then=None):
        future = concurrent.futures.Future()
        future.set_result(then(fn()) if then is not None else fn())
        return future

    def sync(self, chunks, version: int, check: float | None = None):
        self.syncs.append(version)
        self.checks.append(check)


def _rollout(*overrides, **parts) -> Rollout:
    return Rollout(load_config(BASE, list(overrides)), control=dist.group.WORLD, stop_ids=(2, 7),
                   timers=lambda name: contextlib.nullcontext(), **parts)


def test_a_rollout_has_exactly_one_of_an_engine_and_a_server():
    with pytest.raises(ValueError, match="exactly one"):
        _rollout()
    with pytest.raises(ValueError, match="exactly one"):
        _rollout(engine=Engine(), remote=Remote())


def test_every_request_carries_the_runs_stop_ids_and_the_engines_batch_comes_back():
    engine = Engine()
    rollout = _rollout(engine=engine)
    sampling = SamplingConfig(n=2, max_tokens=4, stop_token_ids=(7, 9), seed=3)
    batch = rollout.generate([[11, 12], [13]], sampling)
    (prompts, asked), = engine.asked
    assert prompts == [[11, 12], [13]] and asked.stop_token_ids == (2, 7, 9) and asked.seed == 3 and asked.n == 2
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and [batch.response(i) for i in range(4)] == [[11, 2]] * 2 + [[13, 2]] * 2
    assert not rollout.in_background


def test_weights_are_synced_once_per_version_while_the_student_samples():
    engine = Engine()
    rollout = _rollout("trainer.mode=on_policy", engine=engine)
    rollout.sync([], 1)
    rollout.sync([], 1)  # the version the engine holds: nothing sent
    rollout.sync([], 2)
    assert [version for _, version in engine.loads] == [1, 2] and rollout.version == 2


def test_an_engine_that_reads_the_students_weights_releases_them_before_an_update_and_no_other_does():
    releasing, copying = Engine(releases_weights=True), Engine()
    for engine in (releasing, copying):
        _rollout("trainer.mode=on_policy", engine=engine).release()
    assert (releasing.releases, copying.releases) == (1, 0)


@pytest.mark.parametrize("overrides", [
    ["trainer.mode=off_policy", "rollout.n=1"],  # samples nothing: the engine is for eval
    ["trainer.mode=on_policy", "sample_mix.lmbda=0", "sample_mix.source=teacher"],  # the student never samples
])
def test_a_run_whose_student_does_not_sample_syncs_only_when_forced(overrides):
    engine = Engine()
    rollout = _rollout(*overrides, engine=engine)
    rollout.sync([], 1)
    assert engine.loads == [] and rollout.version == 0
    rollout.sync([], 1, force=True)  # eval refreshes the engine
    assert [version for _, version in engine.loads] == [1] and rollout.version == 1


def test_a_rollout_server_is_asked_on_its_thread_and_synced_through_it():
    remote = Remote()
    rollout = _rollout("trainer.mode=on_policy", remote=remote)
    assert rollout.in_background and rollout.replicas == 1
    sampling = SamplingConfig(n=1, max_tokens=4)
    assert rollout.generate([[5]], sampling).num_samples == 1
    future = rollout.generate_then([[6], [8]], sampling, lambda batch: batch.num_samples)
    assert future.result() == 2
    assert rollout.metrics() == {"rollout/server_restarts": 0}
    assert [asked.stop_token_ids for _, asked in remote.asked] == [(2, 7), (2, 7)]
    rollout.sync(["chunk"], 3)
    assert remote.syncs == [3] and rollout.version == 3
    # The periodic engine check (weight_sync.check_interval, 10): the first sync of a process, then every 10th version.
    for version in (4, 10, 11, 20):
        rollout.sync(["chunk"], version)
    assert remote.checks == [1e-3, None, 1e-3, None, 1e-3]
