"""``eval.scorer`` and its options (issue #45 item 6): the reward kinds' names and options, checked as the config
loads (a user's ``module:function`` when the entry points check it), each refusal naming the ``eval`` key."""

import logging
import pathlib

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.trainer.checks import check_registered_names

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
FUNCTIONS = "tests.unit.rewards.reward_functions"


def _checked(overrides):
    config = load_config(BASE, overrides)
    check_registered_names(config)  # what the trainer's command line and the launcher run next
    return config


def test_the_scorer_options_load_from_the_command_line():
    config = _checked(["eval.scorer=regex", r"eval.pattern=\*\*(?P<answer>.+?)\*\*"])
    assert (config.eval.scorer, config.eval.pattern) == ("regex", r"\*\*(?P<answer>.+?)\*\*")
    assert _checked(["eval.scorer=regex", "eval.pattern='answer is {answer}'"]).eval.pattern == "answer is {answer}"
    assert _checked(["eval.scorer=contains"]).eval.scorer == "contains"
    assert _checked(["eval.scorer=function", f"eval.function={FUNCTIONS}:length_bonus"]).eval.kind == "function"


@pytest.mark.parametrize("overrides, words", [
    (["eval.scorer=contain"], "unknown reward kind eval.scorer='contain'; did you mean 'contains'?"),
    (["eval.scorer=regex"], "eval.scorer='regex' needs eval.pattern: a regular expression"),
    (["eval.scorer=regex", "eval.pattern=(unclosed"], "eval.pattern='(unclosed' is not a regular expression"),
    (["eval.scorer=regex", "eval.pattern='[{answer}]'"], "once {answer} stands for an answer"),
    (["eval.scorer=regex", r"eval.pattern=(?P<answer>\d+){answer}"], "has both {answer} and a group"),
    (["eval.scorer=function"], "eval.scorer='function' needs eval.function: the reward as module:function, importable "
                               "from the trainer's Python path, e.g. eval.function=my_rewards:score"),
    (["eval.scorer=function", "eval.function=my_scores.score"], "eval.function='my_scores.score' must look like "
                                                                "'package.module:function'"),
    (["eval.scorer=math_answer", "eval.tolerance=-1"], "eval.tolerance=-1.0 must be a finite number >= 0"),
    # Imported when the entry points check the config: a typo fails before anything starts.
    (["eval.scorer=function", "eval.function=no_such_scores_module:score"],
     "eval.function='no_such_scores_module:score': module 'no_such_scores_module' does not import"),
    (["eval.scorer=function", f"eval.function={FUNCTIONS}:missing"], "has no attribute 'missing'"),
    (["eval.scorer=function", f"eval.function={FUNCTIONS}:NOT_CALLABLE"],
     f"eval.function='{FUNCTIONS}:NOT_CALLABLE' is not callable (a int)"),
    (["reward.kind=function", f"reward.function={FUNCTIONS}:NOT_CALLABLE"],
     f"reward.function='{FUNCTIONS}:NOT_CALLABLE' is not callable (a int)"),
    (["reward.kind=function", "reward.function=no_such_rewards_module:score"],
     "reward.function='no_such_rewards_module:score': module 'no_such_rewards_module' does not import"),
])
def test_a_bad_scorer_names_the_key_and_the_fix(overrides, words):
    with pytest.raises(ValueError) as caught:
        _checked(overrides)
    assert words in str(caught.value)


def test_a_scorer_option_the_scorer_does_not_read_is_logged_as_inert(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_gkd.rewards.config"):
        _checked(["eval.scorer=contains", "eval.pattern=x", "eval.tolerance=0.5"])
        _checked(["eval.scorer=regex", "eval.pattern=x"])  # read: silent
    assert [r.getMessage() for r in caplog.records] == [
        "eval.pattern='x' has no effect with eval.scorer='contains'",
        "eval.tolerance=0.5 has no effect with eval.scorer='contains'",
    ]
