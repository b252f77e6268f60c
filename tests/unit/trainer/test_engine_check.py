"""The rollout-engine check's figures, its verdict and when it runs (megatron_gkd/trainer/engine_check.py). The real
runs (a stale engine stopping a run; an honest one passing with its figures) are tests/e2e/trainer/test_stale_engine.py
and tests/e2e/trainer/test_hf_rollout.py."""

import math
import types

import pytest
import torch

from megatron_gkd.trainer import engine_check
from megatron_gkd.trainer.batch import Sample, build_microbatch


def test_figures_are_means_over_their_own_tokens_and_absent_without_tokens():
    stats = {"mismatch/k1": 0.2, "mismatch/k3": 0.1, "mismatch/max_ratio": 1.5, "mismatch/max_inverse_ratio": 1.2,
             "mismatch/tokens": 10.0, "engine/abs": 0.04, "engine/tokens": 4.0, "engine/max_abs": 0.03}
    figures = engine_check.metrics(stats)
    assert figures["mismatch/kl_k1"] == pytest.approx(0.02) and figures["mismatch/kl_k3"] == pytest.approx(0.01)
    assert figures["engine/mean_abs_error"] == pytest.approx(0.01) and figures["engine/max_abs_error"] == 0.03
    assert engine_check.metrics({"loss": 1.0, "mismatch/tokens": 0.0, "engine/tokens": 0.0}) == {}


def test_the_check_stops_past_the_tolerance_naming_the_figures_and_passes_within():
    figures = {"engine/tokens": 40.0, "engine/mean_abs_error": 0.03, "engine/max_abs_error": 0.2}
    with pytest.raises(engine_check.StaleRolloutEngine, match=r"at step 7.*40 tokens.*weight version 6.*0\.03 nats"
                       r".*worst token 0\.2.*check_tolerance=0\.001"):
        engine_check.check(figures, tolerance=1e-3, step=7)
    engine_check.check({**figures, "engine/mean_abs_error": 5e-4}, tolerance=1e-3, step=7)
    engine_check.check({}, tolerance=1e-3, step=7)  # nothing compared this step
    with pytest.raises(engine_check.StaleRolloutEngine, match="not finite"):
        engine_check.check({**figures, "engine/mean_abs_error": math.nan}, tolerance=1e-3, step=7)


def test_tolerance_follows_the_coarser_dtype_unless_set():
    def config(student, rollout=None, tolerance=None):
        return types.SimpleNamespace(student=types.SimpleNamespace(dtype=student),
                                     rollout=types.SimpleNamespace(dtype=rollout),
                                     weight_sync=types.SimpleNamespace(check_tolerance=tolerance))

    assert engine_check.tolerance_of(config("float32")) == 1e-3
    assert engine_check.tolerance_of(config("float32", "bfloat16")) == 0.05
    assert engine_check.tolerance_of(config("bfloat16", tolerance=0.2)) == 0.2


def test_due_on_a_process_s_first_batch_and_every_interval():
    assert [engine_check.check_due(10, i, first=i == 3) for i in (3, 4, 10, 11, 20)] == [True, False, True, False, True]
    assert not engine_check.check_due(0, 10, first=True)


def test_current_tokens_are_the_student_s_sampled_with_the_update_s_weights():
    def sample(source="student", versions=None):
        return Sample(tokens=torch.tensor([1, 2, 3, 4]), prompt_len=2, group=0, prompt_index=0,
                      logprobs=torch.tensor([-0.5, -1.0]), source=source, versions=versions)

    samples = [sample(), sample("dataset"), sample(versions=torch.tensor([4, 5]))]
    zeros = [torch.zeros(2)] * 3
    batch = build_microbatch(samples, zeros, version=5, sampled=(5, True))
    sampled = batch.sampled
    assert sampled.student[:, 1:3].tolist() == [[True, True], [False, False], [True, True]]
    assert sampled.current[:, 1:3].tolist() == [[True, True], [False, False], [False, True]]  # a partial sample
    assert sampled.checked and sampled.logprobs[0, 1:3].tolist() == [-0.5, -1.0]
    stale = build_microbatch(samples[:1], zeros[:1], version=5, sampled=(4, False)).sampled  # one_step_off
    assert stale.student.any() and not stale.current.any()
