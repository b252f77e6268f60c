"""The policy-gradient term's inputs of a batch (``rl.combine``): each sample's reward advantage, its tokens'
coefficients and the teacher's log-prob of each sampled token, on every rank of the last pipeline stage.

| input | from | on |
|---|---|---|
| rewards | the reward worker of the TP group's teacher rank (:mod:`.reward_exchange`) | broadcast over the TP group |
| advantages | each prompt group's rewards (:func:`~megatron_gkd.losses.group_advantages`) | this rank's whole groups |
| coefficients | the aggregation over the *global* batch's counts (:func:`~megatron_gkd.losses.aggregation_coefficients`) | every token |
| teacher log-probs | the teacher rows' ``token_logprobs`` (the teacher that scores the sample; a mixture's weighted sum) | last stage |
| teacher baseline | the other samples of the group's ``k1`` at each position (``rl.teacher_baseline``) | last stage |

The step reads them from :class:`~megatron_gkd.trainer.batch.PolicySlice` (``megatron_gkd.trainer.step``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.losses import BatchCounts, aggregation_coefficients, group_advantages
from megatron_gkd.trainer.batch import PolicyShare


def tp_rewards(values: Sequence[float] | None, count: int, tp_group) -> torch.Tensor:
    """This rank's ``count`` rewards on every rank of ``tp_group`` (its rank 0 computed them), float64."""
    if dist.get_world_size(tp_group) == 1:
        assert values is not None and len(values) == count, "the rank that rewards the share holds no rewards"
        return torch.tensor(list(values), dtype=torch.float64)
    device = platform.device()
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device) if values is not None else \
        torch.empty(count, dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return tensor.cpu()


def sample_advantages(groups: Sequence[int], rewards: torch.Tensor, estimator: str, *, eps: float) -> list[float]:
    """Each sample's advantage from the rewards of its prompt group (``groups[i]``: sample ``i``'s group; every
    group whole and of one size, as a data-parallel share holds them).

    Raises:
        ValueError: groups of different sizes (a share cut through a group), or what
            :func:`~megatron_gkd.losses.group_advantages` refuses.
    """
    members: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    sizes = {len(indices) for indices in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"prompt groups of sizes {sorted(sizes)} in one share: each prompt's samples must be whole")
    order = [index for indices in members.values() for index in indices]
    table = rewards[torch.tensor(order)].reshape(len(members), sizes.pop())
    advantages = group_advantages(table, estimator, eps=eps).reshape(-1)
    result = [0.0] * len(groups)
    for index, value in zip(order, advantages.tolist()):
        result[index] = value
    return result


def teacher_token_logprobs(samples, rows: dict, weights: dict[str, float]) -> list[torch.Tensor]:
    """Per sample ``[R_i]`` the teacher's log-prob of each response token: the teacher that scores it, or the
    weighted sum of a mixture's (``rows``: ``{teacher name: (sample indices, TeacherRows)}``)."""
    found = [torch.zeros(s.response_len, dtype=torch.float32) for s in samples]
    for name, (indices, teacher_rows) in rows.items():
        parts = teacher_rows.token_logprobs.split([samples[i].response_len for i in indices])
        for index, values in zip(indices, parts):
            found[index] = found[index] + weights[name] * values.float()
    return found


def teacher_baselines(samples, teacher: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per sample ``[R_i]`` the baseline of each token's ``k1`` (``rl.teacher_baseline``): the mean over the *other*
    samples of its prompt group that reach the same position of their ``k1 = log pi_sampler - log pi_teacher``, 0 where
    none does. Leaving the sample out keeps the baseline independent of its own tokens (no bias)."""
    k1 = [sample.logprobs.float() - values.float() for sample, values in zip(samples, teacher, strict=True)]
    members: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(sample.group, []).append(index)
    baselines = [torch.zeros_like(values) for values in k1]
    for indices in members.values():
        width = max(k1[i].numel() for i in indices)
        sums, counts = torch.zeros(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
        for i in indices:
            sums[: k1[i].numel()] += k1[i].double()
            counts[: k1[i].numel()] += 1
        for i in indices:
            length = k1[i].numel()
            others = counts[:length] - 1
            mean = (sums[:length] - k1[i].double()) / others.clamp_min(1)
            baselines[i] = torch.where(others > 0, mean, torch.zeros_like(mean)).float()
    return baselines


def policy_share(config, samples, rewards: torch.Tensor | None, rows: dict, weights: dict[str, float], *,
                 num_tokens: int, num_sequences: int, step: int = 0) -> PolicyShare:
    """The policy-gradient inputs of this rank's ``samples``.

    Args:
        config: the run's config (``rl``, ``rollout.max_tokens``).
        samples: this rank's share (whole prompt groups).
        rewards: ``[len(samples)]`` their rewards, or None where the combination does not train on rewards.
        rows: the teachers' rows (``TeacherExchange.rows``), read where the teacher is in the advantage.
        weights: each teacher's mixture weight.
        num_tokens, num_sequences: the global batch's response tokens and responses (the aggregation's counts).
        step: the batch's index (the teacher's weight, ``rl.kd_coef_at``).
    """
    rl = config.rl
    combination = rl.combination
    if combination.uses_reward:
        advantages = sample_advantages([s.group for s in samples], rewards, rl.advantage, eps=rl.advantage_eps)
    else:
        advantages = [0.0] * len(samples)
    counts = BatchCounts(num_tokens=num_tokens, num_sequences=num_sequences, max_response_len=config.rollout.max_tokens)
    coefficients = aggregation_coefficients([s.response_len for s in samples], rl.aggregation, counts)
    teacher = teacher_token_logprobs(samples, rows, weights) if combination.teacher_in_advantage else None
    baseline = teacher_baselines(samples, teacher) if teacher is not None and rl.teacher_baseline else None
    return PolicyShare(advantages, coefficients, teacher, baseline, rl.kd_coef_at(step))
