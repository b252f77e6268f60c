"""The policy-gradient term's inputs of a batch (megatron_gkd.trainer.policy, batch.PolicySlice) and the three
combinations' advantages (losses.combinations), against values computed here by hand."""

import types

import pytest
import torch

from megatron_gkd.config.schema import RLConfig
from megatron_gkd.losses.combinations import get_combination, token_advantages
from megatron_gkd.trainer.batch import PolicyShare, Sample, TeacherRows, build_microbatch
from megatron_gkd.trainer.metrics import loss_metrics
from megatron_gkd.trainer.policy import policy_share, sample_advantages, teacher_token_logprobs
from megatron_gkd.trainer.specs import PolicySpec
from megatron_gkd.trainer.step import StepRunner


def _sample(group, prompt, response, logprobs=None):
    tokens = torch.tensor(prompt + response)
    logprobs = torch.tensor(logprobs if logprobs is not None else [-1.0] * len(response))
    return Sample(tokens=tokens, prompt_len=len(prompt), group=group, prompt_index=group, logprobs=logprobs)


def test_advantages_come_from_each_sample_s_own_group_whatever_the_order():
    groups = [7, 3, 7, 3]  # interleaved groups of two
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert sample_advantages(groups, rewards, "dr_grpo", eps=0.0) == [0.5, 0.0, -0.5, 0.0]
    rloo = sample_advantages(groups, rewards, "rloo", eps=0.0)
    assert rloo == [1.0, 0.0, -1.0, 0.0]  # r_i minus the mean of the others
    with pytest.raises(ValueError, match="each prompt's samples must be whole"):
        sample_advantages([1, 1, 2], torch.zeros(3, dtype=torch.float64), "grpo", eps=0.0)


def test_a_mixture_s_teacher_log_prob_is_the_weighted_sum_and_a_route_s_its_teacher_s():
    samples = [_sample(0, [5, 6], [1, 2]), _sample(0, [5, 6], [3])]
    a = TeacherRows(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, 0), torch.tensor([-1.0, -2.0, -3.0]))
    b = TeacherRows(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, 0), torch.tensor([-3.0, -4.0, -5.0]))
    mixed = teacher_token_logprobs(samples, {"a": ([0, 1], a), "b": ([0, 1], b)}, {"a": 0.25, "b": 0.75})
    assert [t.tolist() for t in mixed] == [[-2.5, -3.5], [-4.5]]
    routed = teacher_token_logprobs(samples, {"a": ([1], TeacherRows(a.ids[:1], a.logprobs[:1], a.token_logprobs[:1])),
                                              "b": ([0], TeacherRows(b.ids[:2], b.logprobs[:2], b.token_logprobs[:2]))},
                                    {"a": 1.0, "b": 1.0})
    assert [t.tolist() for t in routed] == [[-3.0, -4.0], [-1.0]]


def test_policy_inputs_sit_at_the_positions_that_predict_each_response_token():
    samples = [_sample(0, [5, 6, 7], [8, 9], [-0.5, -0.25]), _sample(0, [5, 6, 7], [10], [-2.0])]
    config = types.SimpleNamespace(rl=RLConfig(combine="advantage", advantage="dr_grpo", aggregation="sequence_mean"),
                                   rollout=types.SimpleNamespace(max_tokens=4))
    rows = TeacherRows(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, 0), torch.tensor([-1.0, -2.0, -3.0]))
    share = policy_share(config, samples, torch.tensor([1.0, 0.0], dtype=torch.float64), {"t": ([0, 1], rows)},
                         {"t": 1.0}, num_tokens=3, num_sequences=2)
    assert share.advantages == [0.5, -0.5]
    assert [c.tolist() for c in share.coefficients] == [[0.25, 0.25], [0.5]]  # 1 / (S R_i)
    batch = build_microbatch(samples, [torch.zeros(2), torch.zeros(1)], policy=share, version=3, sampled=(3, False))
    policy, sampled = batch.policy, batch.sampled
    # prompt of 3: response token t is predicted at position 2 + t
    assert sampled.token_ids[0, 2:4].tolist() == [8, 9] and sampled.token_ids[1, 2].item() == 10
    assert policy.advantages[0].tolist() == [0, 0, 0.5, 0.5] and policy.advantages[1].tolist() == [0, 0, -0.5, 0]
    assert sampled.logprobs[0].tolist() == [0, 0, -0.5, -0.25]
    assert sampled.student.equal(batch.loss_mask) and sampled.current.equal(batch.loss_mask)
    assert policy.teacher_logprobs[1].tolist() == [0, 0, -3.0, 0]
    assert (policy.coefficients != 0).equal(batch.loss_mask)
    one = build_microbatch(samples[1:], [torch.zeros(1)], policy=share.take([1]), version=4, sampled=(3, True))
    assert one.sampled.checked and one.sampled.student.any() and not one.sampled.current.any()  # sampled one step ago
    assert one.policy.advantages[0, 2].item() == -0.5


def test_the_three_forms_advantages():
    reward = torch.tensor([1.0, 1.0, -1.0])
    student, teacher = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    loss, kl = token_advantages(get_combination("loss"), reward, student, teacher, kd_coef=0.5)
    assert loss.tolist() == reward.tolist() and kl is None
    advantage, kl = token_advantages(get_combination("advantage"), reward, student, teacher, kd_coef=0.5)
    assert kl.tolist() == [0.5, -1.0, 0.0]  # k1 = log pi_s - log pi_t
    assert advantage.tolist() == [0.75, 1.5, -1.0]
    alone, kl = token_advantages(get_combination("teacher"), reward, student, teacher, kd_coef=2.0)
    assert torch.allclose(kl, student - teacher) and torch.allclose(alone, -2.0 * kl)
    for form in ("advantage", "teacher"):  # k3 as an advantage has a biased gradient (test_sampled_kl.py)
        with pytest.raises(ValueError, match="set rl.kl_estimator=k1"):
            token_advantages(get_combination(form), reward, student, teacher, kd_coef=1.0, estimator="k3")
    with pytest.raises(ValueError, match="needs the teacher's log-prob"):
        token_advantages(get_combination("teacher"), reward, student, None, kd_coef=1.0)


def test_policy_metrics_are_per_token_means_and_the_mismatch_s_extremes():
    stats = {"loss": 1.5, "tokens": 4.0, "kd/loss": 1.0, "pg/loss": 0.5, "pg/tokens": 4.0, "pg/advantage": 2.0,
             "pg/clipped": 1.0, "mismatch/k1": 0.4, "mismatch/k3": 0.2, "mismatch/max_ratio": 1.3,
             "mismatch/max_inverse_ratio": 1.1, "mismatch/tokens": 4.0}
    metrics = loss_metrics(stats)
    assert metrics["train/loss"] == 1.5 and metrics["train/kd_loss"] == 1.0 and metrics["pg/loss"] == 0.5
    assert metrics["pg/advantage"] == 0.5 and metrics["pg/clipped"] == 0.25
    assert metrics["mismatch/kl_k1"] == 0.1 and metrics["mismatch/kl_k3"] == 0.05
    assert metrics["mismatch/max_ratio"] == 1.3 and metrics["mismatch/max_inverse_ratio"] == 1.1
    assert "pg/loss" not in loss_metrics({"loss": 1.0, "tokens": 2.0})  # distillation alone: no pg figures
    ratios = loss_metrics({**stats, "pg/ratio": 4.4, "pg/ratio_min": 0.7, "pg/ratio_max": 1.6})
    assert ratios["pg/ratio_mean"] == pytest.approx(1.1) and ratios["pg/ratio_min"] == 0.7
    assert ratios["pg/ratio_max"] == 1.6


def test_a_share_of_reward_advantages_only_reads_no_teacher():
    share = PolicyShare([1.0], [torch.ones(2)])
    assert share.take([0]).teacher_logprobs is None


def test_several_updates_cut_the_micro_batches_and_merge_their_figures():
    def runner(epochs, mini_batches):
        return types.SimpleNamespace(policy=PolicySpec(combination=get_combination("teacher"), ppo_epochs=epochs,
                                                       mini_batches=mini_batches))

    microbatches = list("abcde")
    assert StepRunner._updates(runner(1, 1), microbatches) == [microbatches]
    assert StepRunner._updates(types.SimpleNamespace(policy=None), microbatches) == [microbatches]
    assert StepRunner._updates(runner(2, 2), microbatches) == [list("ab"), list("cde"), list("ab"), list("cde")]
    with pytest.raises(ValueError, match="rl.mini_batches=6 .* this rank has 5 micro-batches"):
        StepRunner._updates(runner(1, 6), microbatches)
    updates = [{"loss": 1.0, "pg/tokens": 4.0, "pg/ratio_max": 1.0, "pg/ratio_min": 1.0},
               {"loss": 3.0, "pg/tokens": 4.0, "pg/ratio_max": 1.3, "pg/ratio_min": 0.6}]
    recorded = {"mismatch/k1": 0.5, "engine/abs": 0.25}
    merged = StepRunner._merge(runner(2, 1), updates, recorded)
    # sums: the mean over the epochs; extremes: over every update; the engine's figures: the recording pass's
    assert merged == {"loss": 2.0, "pg/tokens": 4.0, "pg/ratio_max": 1.3, "pg/ratio_min": 0.6, "mismatch/k1": 0.5,
                      "engine/abs": 0.25}
    assert StepRunner._merge(runner(2, 1), [None, None], None) is None  # not the last pipeline stage


def test_the_teacher_baseline_is_the_other_samples_k1_at_each_position():
    # a group of three (k1 from the sampler's and the teacher's log-probs) and a group of one
    samples = [_sample(0, [5], [1, 2, 3], [-1.0, -1.0, -1.0]), _sample(0, [5], [1, 4], [-2.0, -0.5]),
               _sample(0, [5], [6], [-0.5]), _sample(1, [7], [1, 2], [-1.0, -1.0])]
    teacher = torch.tensor([-2.0, -1.5, -1.0, -2.0, -2.5, -1.0, -3.0, -3.0])
    rows = {"t": ([0, 1, 2, 3], TeacherRows(torch.zeros(8, 0, dtype=torch.int64), torch.zeros(8, 0), teacher))}
    config = types.SimpleNamespace(rl=RLConfig(combine="teacher", teacher_baseline=True),
                                   rollout=types.SimpleNamespace(max_tokens=4))
    share = policy_share(config, samples, None, rows, {"t": 1.0}, num_tokens=8, num_sequences=4)
    # k1 per sample: [1, 0.5, 0], [0, 2], [0.5], [2, 2]; leave-one-out means of the group's others at each position,
    # 0 where no other sample reaches it
    assert [b.tolist() for b in share.teacher_baseline] == [[0.25, 2.0, 0.0], [0.75, 0.5], [0.5], [0.0, 0.0]]
    batch = build_microbatch(samples[:2], [torch.zeros(3), torch.zeros(2)], policy=share.take([0, 1]), version=0,
                             sampled=(0, False))
    assert batch.policy.teacher_baseline[1, :3].tolist() == [0.75, 0.5, 0.0]  # prompt of 1: token t at position t
    # the advantage is -kd_coef x (k1 - baseline); the figure pg/teacher_kl stays k1
    advantages, kl = token_advantages(get_combination("teacher"), torch.zeros(3), torch.tensor([-1.0, -1.0, -1.0]),
                                      teacher[:3], kd_coef=2.0, teacher_baseline=share.teacher_baseline[0])
    assert kl.tolist() == [1.0, 0.5, 0.0] and advantages.tolist() == [-1.5, 3.0, 0.0]
    assert share.take([2]).teacher_baseline[0].tolist() == [0.5]
    no_baseline = policy_share(types.SimpleNamespace(rl=RLConfig(combine="teacher"), rollout=config.rollout), samples,
                               None, rows, {"t": 1.0}, num_tokens=8, num_sequences=4)
    assert no_baseline.teacher_baseline is None


def test_kd_coef_anneals_linearly_then_stays():
    rl = RLConfig(combine="advantage", kd_coef=2.0, kd_coef_end=0.5, kd_coef_steps=3)
    assert [rl.kd_coef_at(step) for step in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.5]
    assert [RLConfig(kd_coef=2.0).kd_coef_at(step) for step in (0, 100)] == [2.0, 2.0]  # no schedule: constant
    samples = [_sample(0, [5], [1], [-1.0]), _sample(0, [5], [2], [-1.0])]
    rows = {"t": ([0, 1], TeacherRows(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0), torch.tensor([-2.0, -3.0])))}
    config = types.SimpleNamespace(rl=RLConfig(combine="teacher", kd_coef=2.0, kd_coef_end=0.5, kd_coef_steps=3),
                                   rollout=types.SimpleNamespace(max_tokens=4))
    share = policy_share(config, samples, None, rows, {"t": 1.0}, num_tokens=2, num_sequences=2, step=2)
    assert share.kd_coef == 1.0 and share.take([1]).kd_coef == 1.0
    batch = build_microbatch(samples, [torch.zeros(1)] * 2, policy=share, version=2, sampled=(2, False))
    assert batch.policy.kd_coef == 1.0 and batch.policy.to(torch.device("cpu")).kd_coef == 1.0
