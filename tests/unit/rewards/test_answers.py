"""Reading final answers: the demo's format, ``####`` and ``\\boxed{}``, numbers written every which way."""

import pytest

from megatron_gkd.rewards import answers

DEMO = "2 3 4 #### 4 3 2"  # the arithmetic task's response to 4 7 + 3 8 5 (digits one token each)


@pytest.mark.parametrize("response, answer, expected", [
    (DEMO, "432", 1.0),
    ("2 3 4 #### 4 3 3", "432", 0.0),
    ("4 3 2", "432", 0.0),                      # no marker: no answer given
    ("#### 1 #### 4 3 2", "432", 1.0),          # the last marker counts
    ("2 3 4 #### 4 3 2 1", "432", 0.0),
    ("2 3 4 ####\n4 3 2\n", "432", 1.0),
    ("####", "432", 0.0),
    ("", "432", 0.0),
])
def test_final_answer_is_the_demo_scorer(response, answer, expected):
    assert answers.final_answer(response, answer) == expected


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-5", -5.0), ("\u22125", -5.0), ("- 5", -5.0), ("+3", 3.0), ("1,234", 1234.0),
    ("-1,234,567.5", -1234567.5), ("1 2 3 4", 1234.0), ("0.5", 0.5), (".5", 0.5), ("18.", 18.0), ("007", 7.0),
    ("$1,000.00", 1000.0), ("50%", 50.0), ("50\\%", 50.0), ("3/4", 0.75), ("\\frac{3}{4}", 0.75),
    ("-\\frac{1}{2}", -0.5), ("\\dfrac{1}{8}", 0.125), ("12\\text{ apples}", 12.0), ("1\\,000", 1000.0),
    ("1,2", None), ("1,2345", None), ("3x", None), ("x = 3", None), ("", None), ("-", None), ("1/0", None),
    ("1/2/3", None), ("abc", None), ("1e5", None),
])
def test_parse_number(text, value):
    assert answers.parse_number(text) == value


@pytest.mark.parametrize("response, answer, expected", [
    (DEMO, "432", 1.0),                                          # the demo's format is a #### answer
    ("so the total is #### 1,234", "1234", 1.0),
    ("#### 1 2 3 4", "1,234", 1.0),
    ("#### -1,234", "-1234", 1.0),
    ("#### \u22125", "-5", 1.0),
    ("#### 5", "-5", 0.0),
    ("#### $1,000.00", "1000", 1.0),
    ("#### 18.", "18", 1.0),
    ("#### 72\nThe answer is 72, as shown.", "72", 1.0),         # text after the answer's line is ignored
    ("Natalia sold 48/2 = 24 clips. \\boxed{72}", "She sold <<48+24=72>>72 clips.\n#### 72", 1.0),  # GSM8K solution
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.3333333}", "1/3", 1.0),                           # within the default tolerance
    ("\\boxed{0.33}", "1/3", 0.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("#### 5, then on reflection \\boxed{6}", "6", 1.0),         # the answer written last counts
    ("\\boxed{6} or rather #### 5", "6", 0.0),
    ("\\boxed{12", "12", 0.0),                                   # unbalanced: no answer
    ("\\boxed{4} then \\boxed{12", "4", 1.0),                     # ... an earlier complete one still is
    ("\\boxed 7", "7", 1.0),
    ("\\boxed{x + 1}", "x+1", 1.0),                               # not numbers: compared as text
    ("\\boxed{3x}", "3", 0.0),
    ("#### 1,2", "12", 0.0),
    ("the answer is 432", "432", 0.0),                           # no marker: no answer
    ("#### ", "0", 0.0),
    ("", "0", 0.0),
])
def test_math_answer(response, answer, expected):
    assert answers.math_answer(response, answer) == expected


def test_math_answer_tolerance_is_relative_above_one_and_absolute_below():
    assert answers.math_answer("#### 1000.5", "1000", tolerance=1e-3) == 1.0
    assert answers.math_answer("#### 1002", "1000", tolerance=1e-3) == 0.0
    assert answers.math_answer("#### 0.0005", "0", tolerance=1e-3) == 1.0
    assert answers.math_answer("#### 1000.5", "1000", tolerance=0.0) == 0.0
