"""Answers in chatty text (issue #45 item 6): ``contains`` and the ``regex`` pattern's three forms on responses as
a chat model writes them, and the numbers inside other numbers that must not count."""

import pytest

from megatron_gkd.rewards.matching import AnswerPattern, contains, core, exact_match


@pytest.mark.parametrize("response, answer, expected", [
    ("The capital of France is Paris.", "Paris", 1.0),
    ("The capital of France is PARIS!", "paris", 1.0),            # any case
    ("I think it's paris, France's capital", "Paris", 1.0),
    ("Parisian cafés are famous.", "Paris", 0.0),                  # inside a longer word
    ("The capital is Lyon.", "Paris", 0.0),
    ("So the answer is **42**.", "42", 1.0),                      # Markdown emphasis and a full stop around it
    ("The answer is `42`", "42", 1.0),
    ("There are 42 apples.", " 42 ", 1.0),
    ("It is 12.", "12", 1.0),                                      # a full stop that ends the sentence
    ("It is 12, I am sure", "12", 1.0),
    ("The answer is 125.", "12", 0.0),                             # "12" is not in "125"
    ("The answer is 512.", "12", 0.0),
    ("The answer is 12.5", "12", 0.0),                             # ... nor in a decimal
    ("The answer is 3.12", "12", 0.0),
    ("The answer is -12", "12", 0.0),                              # -12 is another number
    ("The answer is \u221212", "12", 0.0),
    ("The answer is 12,000", "12", 0.0),                           # ... nor in a number with separators
    ("The answer is 1,200", "200", 0.0),
    ("Take x12 away", "12", 0.0),
    ("It is the 12th", "12", 0.0),
    ("The answer is 3.5.", "3.5", 1.0),
    ("The answer is 3.51", "3.5", 0.0),
    ("The answer is -7.", "-7", 1.0),
    ("It lies in New\n  York.", "new york", 1.0),                  # whitespace runs are one
    ("It lies in NewYork.", "New York", 0.0),
    ("Paris is the capital", "Paris.", 1.0),                       # a reference's own full stop is not the answer
    ("The answer is (B).", "B", 1.0),
    ("Anything at all", "", 0.0),                                  # an empty answer is found nowhere
    ("Anything at all", " ** ", 0.0),
])
def test_contains_finds_the_answer_as_a_whole_word_or_number(response, answer, expected):
    assert contains(response, answer) == expected


def test_exact_match_ignores_only_whitespace():
    assert exact_match("  Paris \n", "Paris") == 1.0
    assert exact_match("The capital is Paris.", "Paris") == 0.0
    assert exact_match("paris", "Paris") == 0.0


def test_core_drops_what_surrounds_an_answer():
    assert core(" **Paris**. ") == "Paris"
    assert core("New \n York") == "New York"
    assert core("-7") == "-7"


@pytest.mark.parametrize("response, answer, expected", [
    ("So the answer is 42.", "42", 1.0),
    ("So the answer is: 42", "42", 1.0),
    ("So the answer is 425.", "42", 0.0),          # {answer} is found as contains finds it: whole
    ("So the answer is 4.", "42", 0.0),
    ("42 apples, so the answer is 7", "42", 0.0),  # the answer must stand where the pattern puts it
    ("the answer is PARIS", "Paris", 1.0),
])
def test_a_pattern_with_the_answer_in_it(response, answer, expected):
    pattern = AnswerPattern(r"answer is:? {answer}")
    assert pattern.reads_answer and pattern(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
    ("So the answer is **42**.", "42", 1.0),
    ("So the answer is ** 42 **.", "42", 1.0),
    ("First **41**, then **42**.", "42", 1.0),      # the last match is the final answer
    ("First **42**, then **41**.", "42", 0.0),
    ("So the answer is **425**.", "42", 0.0),
    ("So the answer is **Paris.**", "paris", 1.0),
    ("So the answer is 42.", "42", 0.0),            # no match: no answer given
])
def test_a_pattern_that_captures_the_answer(response, answer, expected):
    pattern = AnswerPattern(r"\*\*(?P<answer>.+?)\*\*")
    assert pattern.reads_answer and pattern(response, answer) == expected


def test_a_capture_group_that_took_no_part_in_the_match_is_no_answer():
    pattern = AnswerPattern(r"answer(?: is (?P<answer>\d+))?")
    assert pattern("the answer is 42", "42") == 1.0
    assert pattern("no answer here", "42") == 0.0


def test_a_pattern_without_the_answer_checks_the_format_only():
    pattern = AnswerPattern(r"(?s)<think>.+</think>")
    assert not pattern.reads_answer
    assert pattern("<think>a\nb</think> 42", None) == 1.0 and pattern("42", "42") == 0.0


@pytest.mark.parametrize("pattern, words", [
    ("(unclosed", "'(unclosed' is not a regular expression: missing )"),
    ("[{answer}]", "once {answer} stands for an answer"),
    (r"(?P<answer>\d+) is {answer}", "has both {answer} and a group (?P<answer>...): use one"),
])
def test_a_bad_pattern_is_refused_with_the_reason(pattern, words):
    with pytest.raises(ValueError) as caught:
        AnswerPattern(pattern)
    assert words in str(caught.value)
