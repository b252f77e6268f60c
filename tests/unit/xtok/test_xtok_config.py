"""The cross-tokenizer switch: a mismatch is refused unless a method is named (and the refusal names the key), a
map built for another pair is refused, and a method on one shared tokenizer warns that it is inert."""

import logging

import numpy as np
import pytest

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
