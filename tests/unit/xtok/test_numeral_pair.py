"""The cross-tokenizer experiment's pair (issue #29 point 5): the demo's one-token-per-digit tokenizer as the student,
the numeral tokenizer (the answer one token) as the teacher. The answer is an n:1 group, and the chain rule turns the
teacher's distribution over whole numbers into one over each next digit."""

import numpy as np
import pytest

from megatron_gkd.recipes import arithmetic
from megatron_gkd.recipes.numeral_teacher import build_numeral_tokenizer
from megatron_gkd.teacher.types import TeacherOutput
from megatron_gkd.xtok.align import Kind
from megatron_gkd.xtok.config import CrossTokenizerConfig
from megatron_gkd.xtok.request import CrossTokenizer


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
