"""Rewards: one more annotation of a step's samples, computed beside the teacher request.

A ``reward`` section (:class:`RewardConfig`) names a registered kind (:data:`REWARDS`: the built-in verifiers
``final_answer``, ``math_answer``, ``regex``, and ``function`` for the user's ``module:function``); a
:class:`RewardRunner` computes a batch's rewards in a worker process, off the caller's thread, and every failure
(an exception, a hang past ``reward.timeout_s``, a wrong shape, a non-finite value) is a :class:`RewardFailed`
naming the reward and the record::

    runner = RewardRunner(config.reward)
    runner.wait_ready()                                    # a user module that does not import fails here
    future = runner.submit(RewardBatch(prompts, responses, records))   # returns at once
    ...                                                    # the teacher request runs meanwhile
    rewards = future.result().values                      # one finite float per response, or RewardFailed
"""

from megatron_gkd.rewards.answers import final_answer, math_answer
from megatron_gkd.rewards.config import Estimator, RewardConfig, check_reward_settings
from megatron_gkd.rewards.kinds import REWARDS, RewardKind, build_reward, reward_name
from megatron_gkd.rewards.runner import RewardBatch, RewardFailed, RewardOutput, RewardRunner

__all__ = [
    "Estimator",
    "REWARDS",
    "RewardBatch",
    "RewardConfig",
    "RewardFailed",
    "RewardKind",
    "RewardOutput",
    "RewardRunner",
    "build_reward",
    "check_reward_settings",
    "final_answer",
    "math_answer",
    "reward_name",
]
