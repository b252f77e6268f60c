"""DAPO's dynamic sampling (``rl.dynamic_sampling``): a batch trains only prompt groups whose rewards differ, and
draws more prompts until it holds a step's worth of them.

Why: the group estimators (``grpo``, ``rloo``, ``dr_grpo``) give each sample its reward less a baseline from its own
group's rewards, so a group whose ``rollout.n`` rewards are all equal (all solved, all failed) has advantage 0 on
every sample: it trains nothing from the reward but still fills the batch, and the fewer informative groups a batch
holds, the noisier its gradient. DAPO (Yu et al., 2025) drops those groups and samples more prompts to refill the
batch, as verl's DAPO recipe does (``algorithm.filter_groups``).

How a batch is made (:func:`sample_informative`), every rank alike:

| round | what happens |
|---|---|
| 0 | a step's prompts are drawn and sampled; their rewards are computed and gathered on every rank |
| 1, 2, ... | while fewer than a step's groups have differing rewards: more prompts (:func:`next_draw`) |
| end | the first informative groups in the order drawn; short of them, the first groups of equal rewards |

Rounds stop after ``rl.dynamic_sampling_max_rounds`` extra ones; the groups of equal rewards that then fill the batch
(``rl/dynamic_groups_short``) train the teacher's part of the loss, not the reward's.

What stays exact:
- **the data position.** Every round draws from the run's prompt sampler in order and samples with a seed of its
  own (:func:`round_seed`), so resuming at a batch's saved position (the sampler's state before its first draw)
  draws and samples the same rounds, keeps the same groups and trains the same prompts (with ``rollout.seed`` set,
  as for any resume that must repeat its samples).
- **the layouts.** The decision reads the rewards of the whole batch, gathered on every rank
  (:meth:`~megatron_gkd.trainer.flow.BatchFlow` does), so every data-parallel share keeps the same groups.
- **the batch.** It holds ``global_batch_size`` samples as without the filter, so the loss's normalisation, the
  micro-batch cuts and the data-parallel shares work as before; surplus informative groups of the last round are
  not trained (as verl truncates its accumulated batch).

Cost: a round's rewards are waited for before the next round is drawn and before the teacher is asked (only the kept
groups are scored by the teacher), so rewards no longer overlap the teacher's scoring of the same batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer.sample_mix import merge_by_prompt

ROUND_SEED_STRIDE = 100_003
"""Seed offset of each extra round within its batch (a batch's seeds start ``1_000_003`` apart,
:meth:`~megatron_gkd.trainer.flow.BatchFlow._seed`): rounds sample with seeds of their own, reproducibly."""


@dataclasses.dataclass
class DynamicBatch:
    """A batch made by :func:`sample_informative`.

    Attributes:
        records: the kept prompts' records, in batch order.
        rollout: their samples (group ``g`` answers ``records[g]``).
        rewards: each sample's reward, in the rollout's row order (the global batch).
        metrics: ``rl/dynamic_*`` of the batch (see :func:`sample_informative`).
    """

    records: list
    rollout: RolloutBatch
    rewards: list[float]
    metrics: dict[str, float]


def round_seed(batch_seed: int | None, round_index: int) -> int | None:
    """The sampling seed of round ``round_index`` of a batch whose own seed is ``batch_seed`` (None: unseeded)."""
    return None if batch_seed is None else batch_seed + round_index * ROUND_SEED_STRIDE


def informative_groups(rollout: RolloutBatch, rewards: Sequence[float], num_groups: int) -> list[bool]:
    """Per prompt group of ``rollout`` (``0 .. num_groups - 1``): whether its rewards are not all equal.

    Exact equality, as DAPO's ``std > 0``: verifiers give rewards of a few values, and a group that differs by a
    rounding still has a (tiny) advantage.
    """
    assert len(rewards) == rollout.num_samples, "one reward per sample"
    seen: dict[int, set[float]] = {}
    for group, reward in zip(rollout.group_ids.tolist(), rewards):
        seen.setdefault(int(group), set()).add(float(reward))
    return [len(seen.get(group, ())) > 1 for group in range(num_groups)]


def next_draw(num_prompts: int, informative: int, sampled: int) -> int:
    """Prompts the next round draws: the shortfall ``num_prompts - informative`` over the informative fraction seen so
    far (``informative`` of ``sampled`` groups), at most a step's (``num_prompts``), a step's when none was."""
    if informative == 0:
        return num_prompts
    return min(num_prompts, math.ceil((num_prompts - informative) * sampled / informative))


def sample_informative(draw: Callable[[int], list], sample: Callable[[list, int], tuple[RolloutBatch, list[float]]], *,
                       num_prompts: int, max_rounds: int, pad_id: int) -> DynamicBatch:
    """A batch of ``num_prompts`` prompt groups whose rewards differ, drawn round by round.

    Args:
        draw: ``draw(count)``: the next ``count`` prompt records of the run's sampler.
        sample: ``sample(records, round)``: their samples (group ``g`` answers ``records[g]``) and every sample's reward
            (the global batch, the same on every rank).
        num_prompts: prompt groups of a step.
        max_rounds: extra rounds after the first (``rl.dynamic_sampling_max_rounds``).
        pad_id: padding id.

    Returns:
        The batch, with metrics: ``rl/dynamic_rounds`` (rounds sampled), ``rl/dynamic_prompts_drawn``,
        ``rl/dynamic_groups_dropped`` (groups of equal rewards not trained), ``rl/dynamic_groups_short`` (groups of
        equal rewards trained because the rounds ran out), ``rl/dynamic_groups_surplus`` (informative groups sampled
        but not needed) and ``rl/dynamic_informative_fraction`` (of every group sampled).
    """
    rounds: list[tuple[list, RolloutBatch, list[float]]] = []
    informative: list[tuple[int, int]] = []  # (round, group) in the order drawn
    uniform: list[tuple[int, int]] = []
    count = num_prompts
    while True:
        records = draw(count)
        rollout, rewards = sample(records, len(rounds))
        for group, differs in enumerate(informative_groups(rollout, rewards, len(records))):
            (informative if differs else uniform).append((len(rounds), group))
        rounds.append((records, rollout, rewards))
        if len(informative) >= num_prompts or len(rounds) > max_rounds:
            break
        count = next_draw(num_prompts, len(informative), len(informative) + len(uniform))
    kept = informative[:num_prompts]
    short = num_prompts - len(kept)  # the rounds ran out: groups of equal rewards fill the batch
    sampled = len(informative) + len(uniform)
    metrics = {"rl/dynamic_rounds": float(len(rounds)), "rl/dynamic_prompts_drawn": float(sampled),
               "rl/dynamic_groups_dropped": float(len(uniform) - short), "rl/dynamic_groups_short": float(short),
               "rl/dynamic_groups_surplus": float(len(informative) - len(kept)),
               "rl/dynamic_informative_fraction": len(informative) / sampled}
    return _merge(rounds, kept + uniform[:short], pad_id, metrics)


def _merge(rounds, chosen: list[tuple[int, int]], pad_id: int, metrics: dict) -> DynamicBatch:
    """The batch of the ``chosen`` ``(round, group)`` pairs, in that order."""
    records = [rounds[r][0][g] for r, g in chosen]
    first = rounds[0][1]
    if len(rounds) == 1 and chosen == [(0, g) for g in range(len(rounds[0][0]))]:
        return DynamicBatch(records, first, list(rounds[0][2]), metrics)  # the first draw as it was sampled
    positions = [[None] * len(r[0]) for r in rounds]
    for position, (r, g) in enumerate(chosen):
        positions[r][g] = position
    # Every round samples with the same weights (no update comes between them): the first round's version.
    rollout = merge_by_prompt([(positions[r], rounds[r][1]) for r in range(len(rounds))], first.weight_version, pad_id)
    # merge_by_prompt orders the rows by position, each group's rows in their own order: the rewards alike.
    rewards = [reward for r, g in chosen for group, reward in zip(rounds[r][1].group_ids.tolist(), rounds[r][2])
               if int(group) == g]
    return DynamicBatch(records, rollout, rewards, metrics)
