"""``loss.tail_bucket``: off by default, carried to the step's spec, refused where it has no form (TCAD, a teacher of
another tokenizer) naming the key, and inert (a warning) where no top-k divergence is trained on."""

import logging
import pathlib

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.config.schema import MODES, LossConfig
from megatron_gkd.trainer.specs import LossSpec

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"


def test_off_by_default_and_carried_to_the_step():
    assert LossConfig().tail_bucket is False
    config = load_config(BASE, ["loss.type=reverse_kl", "loss.tail_bucket=true"])
    assert LossSpec.from_config(config.loss, MODES["on_policy"], config.teacher).tail_bucket is True
    assert LossSpec.from_config(config.loss, MODES["on_policy"], config.teacher).eval_kl().tail_bucket is False
    default = load_config(BASE, [])
    assert LossSpec.from_config(default.loss, MODES["on_policy"], default.teacher).tail_bucket is False


def test_tcad_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="loss.tail_bucket=true does not apply to loss.type=tcad"):
        LossConfig(type="tcad", tail_bucket=True)
    with pytest.raises(ValueError, match="set loss.tail_bucket=false"):
        load_config(BASE, ["loss.type=tcad", "rollout.logprobs_k=4", "loss.tail_bucket=true"])


def test_a_teacher_of_another_tokenizer_is_refused():
    with pytest.raises(ValueError, match="loss.tail_bucket has no cross-tokenizer form"):
        load_config(BASE, ["teacher.cross_tokenizer.method=projected", "loss.tail_bucket=true"])


def test_inert_without_a_top_k_divergence_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(BASE, ["loss.tail_bucket=true"])
    assert "tail_bucket" not in caplog.text
    with caplog.at_level(logging.WARNING):
        load_config(BASE, ["loss.tail_bucket=true", "trainer.mode=sft", "rollout.n=1"])
    assert "loss.tail_bucket has no effect: no divergence is trained on (trainer.mode=sft" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config(BASE, ["loss.tail_bucket=true", "teacher.signal=hidden"])
    assert "loss.tail_bucket has no effect with teacher.signal=hidden" in caplog.text
