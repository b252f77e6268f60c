"""The cross-tokenizer switch: a mismatch is refused unless a method is named (and the refusal names the key), a
map built for another pair is refused, and a method on one shared tokenizer warns that it is inert. The hidden
signal's ``hidden_support=full`` is refused where it cannot run, naming the key and the fix."""

import dataclasses
import logging
import pathlib

import numpy as np
import pytest

from megatron_gkd.config import load_config
from megatron_gkd.losses.registry import DIVERGENCES, get_divergence
from megatron_gkd.xtok import ProjectionMap
from megatron_gkd.xtok.config import ENABLE_KEY, CrossTokenizerConfig, check_tokenizers


def _map(student_digest: str, teacher_digest: str) -> ProjectionMap:
    return ProjectionMap(student_ids=np.arange(2), teacher_ids=np.arange(2), weights=np.ones(2, np.float32),
                         exact=np.ones(2, bool), student_vocab_size=2, teacher_vocab_size=2,
                         student_digest=student_digest, teacher_digest=teacher_digest, max_pieces=4, decay=0.5)


def test_a_mismatch_is_refused_naming_the_key_that_enables_it():
    with pytest.raises(ValueError, match="mismatched ids is meaningless") as refused:
        check_tokenizers(CrossTokenizerConfig(), student_digest="a" * 64, teacher_digest="b" * 64)
    assert ENABLE_KEY == "teacher.cross_tokenizer.method" and f"{ENABLE_KEY}=projected" in str(refused.value)


def test_a_named_method_enables_it_and_the_map_must_fit_the_pair():
    config = CrossTokenizerConfig(method="hybrid")
    assert check_tokenizers(config, student_digest="a" * 64, teacher_digest="b" * 64,
                            projection=_map("a" * 64, "b" * 64))
    with pytest.raises(ValueError, match="another teacher tokenizer"):
        check_tokenizers(config, student_digest="a" * 64, teacher_digest="b" * 64, projection=_map("a" * 64, "c" * 64))


def test_one_shared_tokenizer_needs_nothing_and_warns_when_a_method_is_set(caplog):
    assert not check_tokenizers(CrossTokenizerConfig(), student_digest="a" * 64, teacher_digest="a" * 64)
    with caplog.at_level(logging.WARNING):
        assert not check_tokenizers(CrossTokenizerConfig(method="projected"), student_digest="a" * 64,
                                    teacher_digest="a" * 64)
    assert "has no effect" in caplog.text


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="did you mean 'hybrid'"):
        CrossTokenizerConfig(method="hybird")
    with pytest.raises(ValueError, match="decay"):
        CrossTokenizerConfig(method="projected", decay=2.0)
    with pytest.raises(ValueError, match="prompt='templat' is not one of template, text; did you mean 'template'"):
        CrossTokenizerConfig(method="projected", prompt="templat")
    assert CrossTokenizerConfig().prompt == "template"  # what the teacher reads when it serves the conversation


BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
CROSS_HIDDEN = ["teacher.cross_tokenizer.method=projected", "teacher.cross_tokenizer.inside_groups=skip",
                "teacher.signal=hidden"]
FULL = "teacher.cross_tokenizer.hidden_support=full"


def test_hidden_support_defaults_to_topk_and_full_is_accepted_where_it_applies():
    assert load_config(BASE, CROSS_HIDDEN).teacher.cross_tokenizer.hidden_support == "topk"
    config = load_config(BASE, CROSS_HIDDEN + [FULL, "loss.type=jsd"])
    assert config.teacher.cross_tokenizer.hidden_support == "full"
    with pytest.raises(ValueError, match="hidden_support='ful' is not one of topk, full; did you mean 'full'"):
        load_config(BASE, CROSS_HIDDEN + ["teacher.cross_tokenizer.hidden_support=ful"])


@pytest.mark.parametrize("overrides, message", [
    (["teacher.signal=topk"], f"{FULL} compares with the teacher's whole distribution, made in the step from its "
                              "hidden states: set teacher.signal=hidden, or teacher.cross_tokenizer.hidden_support=topk"),
    (["loss.fused=true"], f"{FULL} reads the student's logit shard [s, b, V/tp], which loss.fused=true never builds; "
                          "set loss.fused=false, or teacher.cross_tokenizer.hidden_support=topk"),
    (["loss.type=tcad"], "loss.type=tcad has no cross-tokenizer form"),
], ids=["topk_signal", "fused", "tcad"])
def test_full_support_is_refused_where_it_cannot_run(overrides, message):
    with pytest.raises(ValueError) as refused:
        load_config(BASE, CROSS_HIDDEN + [FULL] + overrides)
    assert message in str(refused.value)


def test_full_support_refuses_a_divergence_without_a_cross_tokenizer_form(monkeypatch):
    jsd = dataclasses.replace(get_divergence("jsd"), cross_tokenizer=False)  # as if jsd had none
    monkeypatch.setitem(DIVERGENCES._entries, "jsd", jsd)
    with pytest.raises(ValueError, match=f"{FULL}: loss.type=jsd has no cross-tokenizer form over the whole "
                                         "vocabulary; use forward_kl, kl_rkl, reverse_kl"):
        load_config(BASE, CROSS_HIDDEN + [FULL, "loss.type=jsd"])


def test_full_support_without_a_method_warns_that_it_is_inert(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(BASE, ["teacher.signal=hidden", FULL])
    assert f"{FULL} has no effect without teacher.cross_tokenizer.method" in caplog.text


def test_the_text_prompt_without_a_method_warns_that_it_is_inert(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(BASE, ["teacher.cross_tokenizer.prompt=text"])
    assert "teacher.cross_tokenizer.prompt=text has no effect without teacher.cross_tokenizer.method" in caplog.text
