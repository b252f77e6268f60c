"""A teacher of another tokenizer as the trainer asks it (megatron_gkd/teacher/clients/cross_request.py): what it is sent, how its rows
come back to the student's positions, and the start-up refusal of a mismatch nobody asked for."""

import numpy as np
import pytest

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.teacher.clients.cross_request import CrossTokenizer
from megatron_gkd.teacher.clients.vocab import check_vocab
from megatron_gkd.teacher.protocol.types import TeacherOutput
from megatron_gkd.xtok.align import Kind
from megatron_gkd.xtok.config import CrossTokenizerConfig


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_gkd.recipes.tiny import build_cross_teachers, build_tokenizer

    root = tmp_path_factory.mktemp("xtok_request")
    student = build_tokenizer(root / "student", 64)
    # build_cross_teachers only needs the student's tokenizer and a teacher checkpoint to copy.
    from megatron_gkd.recipes.tiny import build_checkpoint

    for name in ("student", "teacher"):
        build_checkpoint(root / "assets" / name, vocab_size=64, hidden_size=64, num_layers=1, num_heads=1,
                         intermediate_size=64)
        build_tokenizer(root / "assets" / name, 64)
    out = build_cross_teachers(root / "assets", root / "cross")
    return student, AutoTokenizer.from_pretrained(out / "permuted"), AutoTokenizer.from_pretrained(out / "chars")


def _sample(student, prompt: str, response: str, eos: bool = True):
    prompt_ids = student(prompt)["input_ids"]
    response_ids = student(response, add_special_tokens=False)["input_ids"] + ([student.eos_token_id] if eos else [])
    return np.asarray(prompt_ids + response_ids), len(prompt_ids)


def test_a_permuted_vocabulary_aligns_one_to_one_and_maps_each_word_to_its_own_id(tokenizers):
    student, permuted, _ = tokenizers
    cross = CrossTokenizer(CrossTokenizerConfig(method="projected"), student, permuted, student_vocab_size=64)
    tokens, prompt_len = _sample(student, "w3 w4 w5", "w10 w0 w59")
    translated = cross.translate(tokens, prompt_len)
    sequence = translated.sequence
    # The teacher gets the same words in its own ids, never the student's.
    assert permuted.convert_ids_to_tokens(sequence.token_ids[sequence.response_start:].tolist()) == \
        ["w10", "w0", "w59", "</s>"]
    assert sequence.token_ids[sequence.response_start:].tolist() != tokens[prompt_len:].tolist()
    alignment = translated.alignment
    assert alignment.kind.tolist() == [Kind.ONE_TO_ONE] * 3 + [Kind.SPECIAL]
    assert alignment.teacher_position.tolist() == [0, 1, 2, 3]
    # W is the permutation: each student word maps to the teacher id of the same word, weight 1.
    projection = cross.projection
    for word in ("w10", "w0", "w59", "</s>"):
        rows = projection.student_ids == student.convert_tokens_to_ids(word)
        assert projection.teacher_ids[rows].tolist() == [permuted.convert_tokens_to_ids(word)]
        assert projection.weights[rows].tolist() == [1.0]


def test_a_character_teacher_compares_each_word_at_its_first_character(tokenizers):
    student, _, chars = tokenizers
    cross = CrossTokenizer(CrossTokenizerConfig(method="hybrid"), student, chars, student_vocab_size=64)
    tokens, prompt_len = _sample(student, "w1 w2", "w12 w7")
    translated = cross.translate(tokens, prompt_len)
    response = translated.sequence.token_ids[translated.sequence.response_start:]
    assert chars.convert_ids_to_tokens(response.tolist()) == ["w", "1", "2", "w", "7", "</s>"]
    alignment = translated.alignment
    assert alignment.kind.tolist() == [Kind.ONE_TO_MANY, Kind.ONE_TO_MANY, Kind.SPECIAL]
    assert alignment.teacher_position.tolist() == [0, 3, 5]
    assert alignment.counts()["compared"] == 3

    # The teacher's rows (one per teacher token) land on the student's positions at each group's head.
    k = 2
    ids = np.arange(6 * k, dtype=np.int64).reshape(6, k) % 14
    logprobs = np.log(np.full((6, k), 0.25, dtype=np.float32))
    output = TeacherOutput(topk_ids=ids, topk_logprobs=logprobs, token_logprobs=np.full(6, -1.0, np.float32))
    moved = cross.student_output(output, translated)
    assert moved.topk_ids.tolist() == [ids[0].tolist(), ids[3].tolist(), ids[5].tolist()]
    assert moved.token_logprobs.tolist() == [-1.0, -1.0, -1.0]


def _reverse_pair(tokenizers, inside_groups: str):
    """The character tokenizer as the student, the word tokenizer as the teacher: the teacher's word spans several
    student tokens (one word: the characters decode joined)."""
    student, _, chars = tokenizers
    cross = CrossTokenizer(CrossTokenizerConfig(method="projected", inside_groups=inside_groups), chars, student,
                           student_vocab_size=14)
    prompt = chars("w1 w2")["input_ids"]
    response = chars("w12", add_special_tokens=False)["input_ids"] + [chars.eos_token_id]
    translated = cross.translate(np.asarray(prompt + response), len(prompt))
    assert translated.alignment.kind.tolist() == [Kind.MANY_TO_ONE] * 3 + [Kind.SPECIAL]
    words = student.convert_tokens_to_ids(["w12", "w13", "w5", "w1"])
    output = TeacherOutput(topk_ids=np.asarray([words, [2, 0, 0, 0]]),
                           topk_logprobs=np.log(np.asarray([[0.5, 0.2, 0.1, 0.1], [0.9, 0.05, 0, 0]],
                                                           dtype=np.float32)),
                           token_logprobs=np.asarray([-0.7, -0.1], dtype=np.float32))
    return cross, translated, output, chars


def test_positions_inside_a_group_get_an_empty_row_when_skipped(tokenizers):
    cross, translated, output, _ = _reverse_pair(tokenizers, "skip")
    assert translated.alignment.teacher_position.tolist() == [0, -1, -1, 1]
    moved = cross.student_output(output, translated)
    assert moved.topk_ids[0].tolist() == output.topk_ids[0].tolist() and moved.topk_ids[3].tolist() == [2, 0, 0, 0]
    assert np.isneginf(moved.topk_logprobs[1:3]).all()  # nothing compared, no gradient (the loss's empty row)
    assert moved.token_logprobs[1:3].tolist() == [0.0, 0.0]


def test_the_chain_rule_compares_every_position_of_a_longer_teacher_token(tokenizers):
    cross, translated, output, chars = _reverse_pair(tokenizers, "chain")
    assert translated.chained.tolist() == [True, True, True, False]
    moved = cross.student_output(output, translated)
    offset = cross.teacher_vocab_size  # student ids travel as V_t + s

    def row(i):
        found = moved.topk_logprobs[i] > -np.inf
        return dict(zip(chars.convert_ids_to_tokens((moved.topk_ids[i][found] - offset).tolist()),
                        np.exp(moved.topk_logprobs[i][found]).tolist()))

    # The head: every teacher word starts with "w" (0.9 of the teacher's mass, unnormalised like a top-k row).
    assert row(0) == pytest.approx({"w": 0.9})
    # After "w": w12, w13, w1 go on with "1", w5 with "5" (normalised over the words that agree with "w").
    assert row(1) == pytest.approx({"1": 0.8 / 0.9, "5": 0.1 / 0.9})
    # After "w1": only w12 and w13 go on ("w1" itself ends there: what follows it is another teacher position).
    assert row(2) == pytest.approx({"2": 0.5 / 0.7, "3": 0.2 / 0.7})
    # The closing EOS pair stays a teacher-vocabulary row, compared through W.
    assert moved.topk_ids[3].tolist() == [2, 0, 0, 0]


def test_a_mismatch_nobody_asked_for_is_refused_naming_the_key(tokenizers):
    student, permuted, _ = tokenizers
    common = dict(teacher_vocab_size=64, teacher_tokenizer_size=len(permuted), teacher_digest=tokenizer_digest(permuted),
                  student_vocab_size=64, student_tokenizer=student)
    with pytest.raises(ValueError, match=r"tokenizer mismatch.*teacher\.cross_tokenizer\.method=projected"):
        check_vocab(**common)
    alignment = check_vocab(**common, cross_tokenizer=CrossTokenizerConfig(method="hybrid"))
    assert alignment.cross and alignment.real_vocab_size == len(permuted)
    same = check_vocab(**{**common, "teacher_digest": tokenizer_digest(student)},
                       cross_tokenizer=CrossTokenizerConfig(method="hybrid"))
    assert not same.cross  # the same tokenizer: the method has no effect (a warning), the same-tokenizer path


def test_a_saved_map_of_another_pair_is_refused(tokenizers, tmp_path):
    student, permuted, chars = tokenizers
    saved = CrossTokenizer(CrossTokenizerConfig(method="projected"), student, chars,
                           student_vocab_size=64).projection.save(tmp_path / "w.npz")
    with pytest.raises(ValueError, match="another teacher tokenizer"):
        CrossTokenizer(CrossTokenizerConfig(method="projected", projection_map=str(saved)), student, permuted,
                       student_vocab_size=64)
