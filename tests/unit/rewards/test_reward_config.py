"""The ``reward`` section's checks and the cross-checks with ``rollout.n`` and the advantage estimator."""

import dataclasses
import logging

import pytest
from omegaconf import OmegaConf

from megatron_gkd.rewards import RewardConfig, check_reward_settings


def test_defaults_compute_no_reward_and_the_section_loads_as_a_structured_config():
    assert not RewardConfig().enabled
    load = lambda *dotlist: OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RewardConfig),  # noqa: E731
                                                                 OmegaConf.from_dotlist(list(dotlist))))
    config = load("kind=regex", 'pattern="####"', "timeout_s=5")
    assert isinstance(config, RewardConfig) and config.pattern == "####" and config.timeout_s == 5.0
    # Unquoted, YAML reads '####' as a comment: the error says how to quote it.
    with pytest.raises(ValueError, match="needs reward.pattern: .*quote a pattern that starts with '#'"):
        load("kind=regex", "pattern=####")


@pytest.mark.parametrize("settings, words", [
    ({"kind": "final_anser"}, "unknown reward kind reward.kind='final_anser'; did you mean 'final_answer'?"),
    ({"kind": "function"}, "reward.kind='function' needs reward.function: the reward as module:function"),
    ({"kind": "regex"}, "reward.kind='regex' needs reward.pattern"),
    ({"function": "m:f"}, "reward.function is set but reward.kind is null"),
    ({"pattern": "x"}, "reward.pattern is set but reward.kind is null"),
    ({"format_pattern": "x"}, "reward.format_pattern is set but reward.kind is null"),
    ({"kind": "function", "function": "my_rewards.score"}, "must look like 'package.module:function'"),
    ({"kind": "function", "function": "m:f(x)"}, "must look like 'package.module:function'"),
    ({"kind": "regex", "pattern": "(unclosed"}, "reward.pattern='(unclosed' is not a regular expression"),
    ({"kind": "final_answer", "format_pattern": "[a"}, "reward.format_pattern='[a' is not a regular expression"),
    ({"kind": "math_answer", "tolerance": -1e-3}, "reward.tolerance=-0.001 must be a finite number >= 0"),
    ({"kind": "math_answer", "tolerance": float("nan")}, "reward.tolerance=nan"),
    ({"kind": "final_answer", "format_coef": float("inf")}, "reward.format_coef=inf must be finite"),
    ({"kind": "final_answer", "timeout_s": 0}, "reward.timeout_s=0 must be > 0 seconds"),
    ({"kind": "final_answer", "max_abs": 0.0}, "reward.max_abs=0.0 must be a finite number > 0"),
    ({"kind": "final_answer", "max_abs": float("inf")}, "reward.max_abs=inf must be a finite number > 0"),
    ({"kind": "final_answer", "start_timeout_s": -1}, "reward.start_timeout_s=-1 must be > 0 seconds"),
])
def test_invalid_sections_name_the_key_and_the_fix(settings, words):
    with pytest.raises(ValueError) as caught:
        RewardConfig(**settings)
    assert words in str(caught.value)


def test_options_the_kind_does_not_read_are_logged_as_inert(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_gkd.rewards.config"):
        RewardConfig(kind="final_answer", tolerance=0.1, pattern="x")
        RewardConfig(kind="regex", pattern="x", format_coef=0.5)
        RewardConfig(kind="math_answer", tolerance=0.1, format_pattern="####", format_coef=0.5)  # all read: silent
    assert [r.getMessage() for r in caplog.records] == [
        "reward.pattern='x' has no effect with reward.kind='final_answer'",
        "reward.tolerance=0.1 has no effect with reward.kind='final_answer'",
        "reward.format_coef=0.5 has no effect without reward.format_pattern",
    ]


@dataclasses.dataclass(frozen=True)
class Estimator:
    """Stands in for a registered advantage estimator (the check asks its group size, never its name)."""

    name: str
    min_group_size: int


GRPO, RLOO, REINFORCE = Estimator("grpo", 2), Estimator("rloo", 2), Estimator("reinforce", 1)


@pytest.mark.parametrize("advantage", [GRPO, RLOO])
def test_group_baselines_need_several_samples_per_prompt(advantage):
    reward = RewardConfig(kind="final_answer")
    check_reward_settings(reward, rollout_n=2, advantage=advantage)
    with pytest.raises(ValueError) as caught:
        check_reward_settings(reward, rollout_n=1, advantage=advantage, advantage_key="loss.advantage")
    assert (f"loss.advantage='{advantage.name}' compares the rollout.n samples of each prompt with each other, so it "
            "needs rollout.n >= 2, got rollout.n=1") in str(caught.value)
    assert "set rollout.n=4 or more" in str(caught.value)


def test_a_group_baseline_without_a_reward_is_refused():
    with pytest.raises(ValueError) as caught:
        check_reward_settings(RewardConfig(), rollout_n=8, advantage=GRPO)
    message = str(caught.value)
    assert ("advantage='grpo' compares the rewards of each prompt's samples, but reward.kind is null (a reward "
            "without a verifier: every advantage would be 0)") in message
    assert "'final_answer'" in message and "reward.function=module:function" in message


def test_rewards_without_an_advantage_are_only_measured_and_reinforce_needs_neither():
    check_reward_settings(RewardConfig(kind="final_answer"), rollout_n=1, advantage=None)
    check_reward_settings(RewardConfig(), rollout_n=1, advantage=None)
    check_reward_settings(RewardConfig(), rollout_n=1, advantage=REINFORCE)


def test_the_registered_estimators_answer_what_the_check_asks():
    advantages = pytest.importorskip("megatron_gkd.losses.advantages")  # the policy-gradient term's registry
    with pytest.raises(ValueError, match="needs rollout.n >= 2"):
        check_reward_settings(RewardConfig(kind="final_answer"), 1, advantages.get_advantage_estimator("grpo"))
    check_reward_settings(RewardConfig(), 1, advantages.get_advantage_estimator("reinforce"))
