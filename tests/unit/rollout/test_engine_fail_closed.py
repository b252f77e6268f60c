"""A weight update that fails part-way leaves the engine stale: it refuses to generate (issue 14, item 7).

The fail-closed state lives on :class:`RolloutEngine`, so every engine has it without its own code: the
stand-in below loads tensors one by one as vLLM's in-place reload does, and its stream breaks after
the first tensor (a corrupted bucket, a dead sender).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gkd.rollout import RolloutEngine, SamplingConfig, StaleWeightsError
from megatron_gkd.testing.weight_sync import RecordingEngine

SAMPLING = SamplingConfig(n=1, max_tokens=2)
NEW = [("a", torch.ones(2)), ("b", torch.ones(3))]


def _broken_stream():
    yield NEW[0]
    raise RuntimeError("bucket 2: checksum 17 != sent 18")


def test_a_failed_update_marks_the_engine_stale_until_a_complete_one():
    engine = RecordingEngine()
    assert not engine.stale and engine.generate([[1, 2]], SAMPLING).weight_version == 0
    with pytest.raises(RuntimeError, match="checksum"):
        engine.load_weights(_broken_stream(), version=1)
    assert sorted(engine.weights) == ["a"]  # half updated: what fail-closed is about
    assert engine.stale and engine.weight_version == 0
    with pytest.raises(StaleWeightsError, match=r"version 1.*checksum 17 != sent 18"):
        engine.generate([[1, 2]], SAMPLING)
    engine.load_weights(iter(NEW), version=1)
    assert not engine.stale and engine.stale_reason is None
    assert engine.generate([[1, 2]], SAMPLING).weight_version == 1


def test_every_engine_subclass_gets_the_guard_and_a_receiver_can_mark_it():
    class Minimal(RolloutEngine):
        def generate(self, prompts, sampling):
            return "sampled"

    engine = Minimal(max_model_len=16)
    assert engine.generate([[1]], SAMPLING) == "sampled"
    engine.mark_stale("verify found vLLM's log-probs 0.3 away from the student's after version 4")
    with pytest.raises(StaleWeightsError, match="0.3 away"):
        engine.generate([[1]], SAMPLING)
