"""The colocated sync's receiver: the exporter's tensors checked against the plan and streamed into the engine, and
the stream read to its end whatever fails (its gathers are collectives of every trainer rank)."""

from __future__ import annotations

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.testing.weight_sync import RecordingEngine
from megatron_gkd.weight_sync import ColocatedReceiver, TensorSpec, WeightSyncConfig, WeightSyncError, WeightSyncPlan
from megatron_gkd.weight_sync.colocated import planned_tensors


def _plan() -> WeightSyncPlan:
    shapes = {"embed": (32, 8), "q": (8, 8), "norm": (8,), "head": (32, 8)}
    entries = tuple(TensorSpec(name=name, shape=shape, dtype="bfloat16" if name == "q" else "float32", pp_rank=0,
                               vpp_chunk=0, tp_dim=None, tp_size=1, expert=None, megatron="m." + name, part=0,
                               fusion={"type": "Identity"}, position=i, owner=0, shards=(0,))
                    for i, (name, shape) in enumerate(shapes.items()))
    return WeightSyncPlan(entries=entries, trainer_world_size=1)


def _exported(plan, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(entry.name, torch.randn(entry.shape, generator=generator)) for entry in reversed(plan.entries)]


class _Counted:
    """The exporter's stream, counting what was read of it."""

    def __init__(self, pairs):
        self.pairs, self.read = list(pairs), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.read == len(self.pairs):
            raise StopIteration
        self.read += 1
        return self.pairs[self.read - 1]


def test_every_planned_tensor_arrives_in_the_plans_dtype_whatever_the_order():
    plan = _plan()
    exported = _exported(plan)
    got = dict(planned_tensors(plan, exported))
    assert sorted(got) == sorted(e.name for e in plan.entries)
    for name, tensor in exported:
        entry = next(e for e in plan.entries if e.name == name)
        assert got[name].dtype == entry.torch_dtype
        assert torch.equal(got[name], tensor.to(entry.torch_dtype))


@pytest.mark.parametrize("break_it, message", [
    (lambda pairs: pairs + [("lm_head.extra", torch.zeros(2))], "'lm_head.extra' is not in the weight-sync plan"),
    (lambda pairs: pairs + pairs[:1], "'head' came twice"),
    (lambda pairs: [(n, t[:-1] if n == "embed" else t) for n, t in pairs], "'embed' has shape (31, 8), the plan's"),
    (lambda pairs: pairs[1:], "never produced 1 planned tensors ('head', ...)"),
])
def test_a_stream_the_plan_does_not_describe_is_refused_naming_the_tensor(break_it, message):
    plan = _plan()
    with pytest.raises(WeightSyncError) as error:
        list(planned_tensors(plan, break_it(_exported(plan))))
    assert message in str(error.value)


def test_the_engine_takes_every_tensor_and_the_version():
    plan = _plan()
    engine, receiver = RecordingEngine(), ColocatedReceiver(plan, WeightSyncConfig(transport="colocated"))
    stream = _Counted(_exported(plan))
    assert receiver.sync(engine, stream, version=3) == 3
    assert receiver.version == engine.weight_version == 3 and not engine.stale
    assert stream.read == len(plan.entries)
    assert torch.equal(engine.weights["q"], dict(_exported(plan))["q"].to(torch.bfloat16))
    with pytest.raises(WeightSyncError, match="weight version 3 is not newer than the engine's 3"):
        receiver.sync(engine, _Counted(_exported(plan)), version=3)


class _FailingEngine(RecordingEngine):
    def load_weights(self, named_tensors, version: int) -> None:
        for count, (name, tensor) in enumerate(named_tensors):
            if count == 1:
                raise RuntimeError("reload failed")
            self.weights[name] = tensor.clone()


@pytest.mark.parametrize("engine_type, exported, message", [
    (_FailingEngine, _exported, "RuntimeError: reload failed"),
    (RecordingEngine, lambda plan: _exported(plan)[:2] + [("bogus", torch.zeros(1))] + _exported(plan)[2:],
     "'bogus' is not in the weight-sync plan"),
])
def test_a_failed_load_leaves_the_engine_stale_and_reads_the_stream_to_its_end(engine_type, exported, message):
    plan = _plan()
    engine, receiver = engine_type(), ColocatedReceiver(plan, WeightSyncConfig(transport="colocated"))
    stream = _Counted(exported(plan))
    with pytest.raises(WeightSyncError, match=message):
        receiver.sync(engine, stream, version=1)
    assert stream.read == len(stream.pairs)  # the other ranks' gathers were not left waiting
    assert engine.stale and receiver.version == 0
    with pytest.raises(Exception, match="refuses to generate"):
        engine.generate([[1]], SamplingConfig())


class _Scoring(RecordingEngine):
    """An engine whose prompt log-probs are given."""

    def __init__(self, logprobs: torch.Tensor):
        super().__init__()
        self.logprobs = logprobs

    def prompt_logprobs(self, prompts) -> torch.Tensor:
        return self.logprobs


def test_the_periodic_check_compares_the_mean_and_verify_the_worst_token():
    """weight_sync.check_interval's sync check (check=tolerance) stops an engine off on average and lets one token of
    bf16-like noise pass; weight_sync.verify holds every token to verify_tolerance; a check leaves the engine stale."""
    expected = torch.zeros(7, dtype=torch.float64)
    noisy = expected.clone()
    noisy[3] = 0.08  # one token off by bf16's worst, the mean 0.011
    receiver = ColocatedReceiver(_plan(), WeightSyncConfig(transport="colocated"))
    assert receiver.verify(_Scoring(noisy), expected, check=0.05) == pytest.approx(0.08 / 7)
    stale = _Scoring(expected + 0.06)
    with pytest.raises(WeightSyncError, match=r"differ from the student's by 6\.000e-02 on average \(> 5\.0e-02\)"):
        receiver.verify(stale, expected, check=0.05)
    assert stale.stale
    strict = ColocatedReceiver(_plan(), WeightSyncConfig(transport="colocated", verify=True, verify_tolerance=1e-4))
    with pytest.raises(WeightSyncError, match=r"by 8\.000e-02 \(> 1\.0e-04\)"):  # verify wins over the check
        strict.verify(_Scoring(noisy), expected, check=0.05)
