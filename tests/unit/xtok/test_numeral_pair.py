"""The cross-tokenizer experiment's pair (issue #29 point 5): the demo's one-token-per-digit tokenizer as the student,
the numeral tokenizer (the answer one token) as the teacher. The answer is an n:1 group, and the chain rule turns the
teacher's distribution over whole numbers into one over each next digit."""

import numpy as np
import pytest

from megatron_gkd.recipes import arithmetic
from megatron_gkd.recipes.numeral_teacher import build_numeral_tokenizer
from megatron_gkd.teacher.clients.cross_request import CrossTokenizer
from megatron_gkd.teacher.protocol.types import TeacherOutput
from megatron_gkd.xtok.align import Kind
from megatron_gkd.xtok.config import CrossTokenizerConfig


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("numeral_pair")
    train, _ = arithmetic.make_problems(200, 10)
    student = arithmetic.train_tokenizer(root / "digits", [f"{r['prompt']} {r['response']}" for r in train])
    return student, build_numeral_tokenizer(root / "numerals")


def test_the_answer_is_a_many_to_one_group_and_the_chain_rule_reads_digits_off_whole_numbers(pair):
    student, teacher = pair
    cross = CrossTokenizer(CrossTokenizerConfig(method="projected"), student, teacher, student_vocab_size=len(student))
    prompt = student("4 2 2 + 6 8 7 =")["input_ids"]
    response = student("9 0 1 1 #### 1 1 0 9", add_special_tokens=False)["input_ids"] + [student.eos_token_id]
    translated = cross.translate(np.asarray(prompt + response), len(prompt))
    sequence = translated.sequence
    assert teacher.convert_ids_to_tokens(sequence.token_ids.tolist()) == [
        "4", "2", "2", "+", "6", "8", "7", "=", "9", "0", "1", "1", "####", "1 1 0 9", "</s>"]
    kinds = translated.alignment.kind.tolist()
    assert kinds == [Kind.ONE_TO_ONE] * 5 + [Kind.MANY_TO_ONE] * 4 + [Kind.SPECIAL]
    assert translated.chained.tolist() == [False] * 5 + [True] * 4 + [False]

    # The teacher's row predicting the answer (teacher response position 5): whole numbers.
    rows = np.zeros((7, 4), dtype=np.int64)
    logprobs = np.full((7, 4), -np.inf, dtype=np.float32)
    for row in range(7):  # the digits and the marker, and the end: no concern here
        rows[row, 0], logprobs[row, 0] = sequence.token_ids[sequence.response_start + row], 0.0
    rows[5] = teacher.convert_tokens_to_ids(["1 1 0 9", "1 1 0", "9 1", "1 0 1 9"])
    assert teacher.unk_token_id not in rows[5]
    logprobs[5] = np.log([0.6, 0.2, 0.1, 0.05])
    output = TeacherOutput(topk_ids=rows, topk_logprobs=logprobs, token_logprobs=np.zeros(7, dtype=np.float32))
    moved = cross.student_output(output, translated)
    offset = cross.teacher_vocab_size

    def digits(i):
        found = moved.topk_logprobs[i] > -np.inf
        return dict(zip(student.convert_ids_to_tokens((moved.topk_ids[i][found] - offset).tolist()),
                        np.exp(moved.topk_logprobs[i][found]).tolist()))

    assert digits(5) == pytest.approx({"1": 0.85, "9": 0.1})  # the first digit, unnormalised
    assert digits(6) == pytest.approx({"1": 0.8 / 0.85, "0": 0.05 / 0.85})  # given "1", renormalised
    assert digits(7) == pytest.approx({"0": 1.0})  # given "1 1": 1109 and 110 go on with "0"
    assert digits(8) == pytest.approx({"9": 1.0})  # given "1 1 0": "1 1 0" itself ends there and is left out
    # "####" and the digits before it are 1:1 heads, compared through W (teacher ids: the same symbols').
    assert moved.topk_ids[4, 0] == teacher.convert_tokens_to_ids("####")


def test_text_boundaries_keep_a_short_answer_from_being_taught_to_stop(pair):
    """The failure the experiment found (docs/results.md): a student that writes only "1" of the answer 1109 reads,
    at the teacher's boundaries, a teacher that saw the *number* 1 and says "stop"; read at the text level the
    teacher says "go on with 1" (its mass on 1109, which extends 1 past the boundary)."""
    student, teacher = pair
    prompt = student("4 2 2 + 6 8 7 =")["input_ids"]
    response = student("9 0 1 1 #### 1", add_special_tokens=False)["input_ids"] + [student.eos_token_id]
    rows = {}
    for boundary in ("teacher", "text"):
        cross = CrossTokenizer(CrossTokenizerConfig(method="projected", boundary=boundary), student, teacher,
                               student_vocab_size=len(student))
        translated = cross.translate(np.asarray(prompt + response), len(prompt))
        sequence = translated.sequence
        assert teacher.convert_ids_to_tokens(sequence.response_ids.tolist()) == [
            "9", "0", "1", "1", "####", "1", "</s>"]
        ids = np.zeros((7, 3), dtype=np.int64)
        logprobs = np.full((7, 3), -np.inf, dtype=np.float32)
        for row in range(7):
            ids[row, 0], logprobs[row, 0] = sequence.response_ids[row], 0.0
        ids[5] = teacher.convert_tokens_to_ids(["1 1 0 9", "1", "1 0 0 9"])  # the answer's row
        logprobs[5] = np.log([0.9, 0.01, 0.05])
        ids[6, 0], logprobs[6, 0] = teacher.eos_token_id, np.log(0.99)  # after the number 1: stop
        tokens = logprobs[np.arange(7), 0].copy()
        tokens[5] = np.log(0.01)  # the teacher's log-prob of its own token "1"
        output = TeacherOutput(topk_ids=ids, topk_logprobs=logprobs, token_logprobs=tokens)
        moved = cross.student_output(output, translated)
        offset = cross.teacher_vocab_size
        found = moved.topk_logprobs[6] > -np.inf
        rows[boundary] = dict(zip(moved.topk_ids[6][found].tolist(), np.exp(moved.topk_logprobs[6][found]).tolist()))
        if boundary == "text":
            rows[boundary] = {student.convert_ids_to_tokens(i - offset): p for i, p in rows[boundary].items()}
    assert rows["teacher"] == pytest.approx({teacher.eos_token_id: 0.99})  # teacher ids, through W: "stop"
    # Read at the text level: 1109 and 1009 go on past "1" (0.95), the number 1 itself ended (0.01) then stops.
    assert rows["text"] == pytest.approx({"1": 0.9 / 0.96, "0": 0.05 / 0.96, "</s>": 0.01 * 0.99 / 0.96})


def test_text_the_teacher_cannot_spell_is_left_unaligned(pair):
    """An answer outside the numeral tokenizer's numbers (9991: it knows 0..1999) is its unknown token: the teacher
    would score a token it never learnt to read, so the response is counted as unaligned, not compared."""
    student, teacher = pair
    cross = CrossTokenizer(CrossTokenizerConfig(method="projected"), student, teacher, student_vocab_size=len(student))
    prompt = student("4 2 2 + 6 8 7 =")["input_ids"]
    for answer, aligned in (("1 1 0 9", True), ("9 9 9 1", False)):
        response = student(f"9 0 1 1 #### {answer}", add_special_tokens=False)["input_ids"] + [student.eos_token_id]
        translated = cross.translate(np.asarray(prompt + response), len(prompt))
        assert translated.aligned == aligned
        assert (translated.alignment.counts()["unaligned"] == len(response)) == (not aligned)
