"""The reward kinds, called in this process: built-ins on the demo's data, the user function's loading,
the format reward, and what each kind declares it needs."""

import json

import pytest

from megatron_gkd.recipes import arithmetic
from megatron_gkd.rewards import REWARDS, RewardBatch, RewardConfig, RewardFailed, RewardRunner, build_reward, reward_name
from megatron_gkd.rewards.kinds import kind_target, load_function

FUNCTIONS = "tests.unit.rewards.reward_functions"


def _rewards(config: RewardConfig, responses: list[str], answers: list) -> list[float]:
    records = [{"index": i, "answer": answer} for i, answer in enumerate(answers)]
    return list(build_reward(config)(["p"] * len(responses), responses, records))


def test_final_answer_rewards_the_demo_reference_responses_and_not_a_wrong_digit():
    train, _ = arithmetic.make_problems(200, 50, seed=0)
    right = [record["response"] for record in train]
    wrong = [response[:-1] + str((int(response[-1]) + 1) % 10) for response in right]
    answers = [record["answer"] for record in train]
    assert _rewards(RewardConfig(kind="final_answer"), right, answers) == [1.0] * 200
    assert _rewards(RewardConfig(kind="final_answer"), wrong, answers) == [0.0] * 200
    assert _rewards(RewardConfig(kind="math_answer"), right, answers) == [1.0] * 200
    assert _rewards(RewardConfig(kind="math_answer"), wrong, answers) == [0.0] * 200


def test_integer_answers_are_compared_as_text():
    assert _rewards(RewardConfig(kind="final_answer"), ["#### 4 3 2"], [432]) == [1.0]
    assert _rewards(RewardConfig(kind="math_answer"), ["\\boxed{432}"], [432]) == [1.0]


def test_math_answer_reads_its_tolerance():
    assert _rewards(RewardConfig(kind="math_answer", tolerance=0.01), ["#### 3.14"], ["3.1416"]) == [1.0]
    assert _rewards(RewardConfig(kind="math_answer"), ["#### 3.14"], ["3.1416"]) == [0.0]


def test_regex_rewards_a_match_anywhere_and_takes_inline_flags():
    config = RewardConfig(kind="regex", pattern=r"(?s)<think>.+</think>\s*####")
    assert _rewards(config, ["<think>a\nb</think> #### 4", "<think></think> #### 4", "no", ""], [None] * 4) == [
        1.0, 0.0, 0.0, 0.0]


CHATTY = ["The capital of France is Paris.", "So the answer is **42**.", "The answer is **425**.", "paris, of course",
          "  42 "]
ANSWERS = ["Paris", "42", "42", "Paris", "42"]


@pytest.mark.parametrize("settings, expected", [
    ({"kind": "exact_match"}, [0.0, 0.0, 0.0, 0.0, 1.0]),
    ({"kind": "contains"}, [1.0, 1.0, 0.0, 1.0, 1.0]),
    ({"kind": "regex", "pattern": r"(?i)(?:is|answer is:?) {answer}"}, [1.0, 0.0, 0.0, 0.0, 0.0]),
    ({"kind": "regex", "pattern": r"\*\*(?P<answer>.+?)\*\*"}, [0.0, 1.0, 0.0, 0.0, 0.0]),
])
def test_kinds_for_chatty_answers(settings, expected):
    assert _rewards(RewardConfig(**settings), CHATTY, ANSWERS) == expected


def test_a_regex_that_reads_the_answer_stops_at_a_record_without_one():
    config = RewardConfig(kind="regex", pattern="is {answer}")
    with RewardRunner(config) as runner, pytest.raises(RewardFailed, match="it has no 'answer'"):
        runner.compute(RewardBatch(["p"], ["it is 4"], [{"index": 3, "answer": None}]))


def test_format_reward_adds_its_coefficient_to_any_kind():
    config = RewardConfig(kind="final_answer", format_pattern=r"####\s*\d", format_coef=0.25)
    assert _rewards(config, ["#### 4 3 2", "#### 4 3 3", "4 3 2"], ["432"] * 3) == [1.25, 0.25, 0.0]
    numpy_config = RewardConfig(kind="function", function=f"{FUNCTIONS}:as_numpy", format_pattern="x")
    assert _rewards(numpy_config, ["x", "y", "x"], [None] * 3) == [0.1, 1.0, 2.1]
    assert reward_name(config) == "final_answer + format" == build_reward(config).name


def test_user_function_is_imported_by_name_and_called_with_the_batch():
    config = RewardConfig(kind="function", function=f"{FUNCTIONS}:length_bonus")
    assert _rewards(config, ["#### 7", "abc"], ["7", "7"]) == [1.6, 0.3]
    assert build_reward(config).name == reward_name(config) == f"{FUNCTIONS}:length_bonus"


@pytest.mark.parametrize("target, error, words", [
    ("no_such_module_for_rewards:fn", ImportError, "'no_such_module_for_rewards' does not import"),
    (f"{FUNCTIONS}:missing", ValueError, "has no attribute 'missing'"),
    (f"{FUNCTIONS}:NOT_CALLABLE", ValueError, "is not callable (a int)"),
    ("json", ValueError, "must look like 'package.module:function'"),
])
def test_a_user_function_that_cannot_be_loaded_is_named(target, error, words):
    with pytest.raises(error, match="reward.function=") as caught:
        load_function(target)
    assert words in str(caught.value) and target in str(caught.value)


def test_dotted_attributes_load():
    assert load_function("json:JSONDecoder.decode") is json.JSONDecoder.decode


def test_kinds_declare_what_they_need_and_unknown_kinds_get_the_closest_name():
    assert REWARDS.names() == ["contains", "exact_match", "final_answer", "function", "math_answer", "regex"]
    for kind in ("contains", "exact_match", "final_answer", "math_answer"):
        assert REWARDS.get(kind).needs_for(RewardConfig(kind=kind)) == ("answer",)
    assert REWARDS.get("regex").needs == REWARDS.get("function").needs == ()
    for pattern, needs in (("####", ()), ("is {answer}", ("answer",)), (r"\*\*(?P<answer>.+?)\*\*", ("answer",))):
        assert REWARDS.get("regex").needs_for(RewardConfig(kind="regex", pattern=pattern)) == needs
    assert [option for option, _ in REWARDS.get("function").required] == ["function"]
    assert kind_target("math_answer") == "megatron_gkd.rewards.kinds:MathAnswer"
    with pytest.raises(ValueError, match=r"reward.kind='final_anser'; did you mean 'final_answer'\?"):
        REWARDS.get("final_anser")
