"""A batch's rewards, the first annotation of its samples (:mod:`.annotations`): sent beside the teacher request,
waited for before the step trains, and measured over the global batch; the batch keeps them under ``rewards``.

| when | what :class:`RewardExchange` does | collective |
|---|---|---|
| start-up | :meth:`wait_ready`: the worker has built the reward (a user module that does not import fails here) | every rank |
| sampling | :meth:`send`: the decoded prompts, responses and records of this rank's share go to the worker | no |
| update | :meth:`receive`: waits (timer ``reward_wait``); a ``RewardFailed`` on any rank stops every rank | every rank |
| sampling | ``rl.dynamic_sampling``: per round :meth:`send`, :meth:`receive`, :meth:`gather`; then :meth:`known` | every rank |
| update | :meth:`metrics`: ``reward/mean``, ``reward/min``, ``reward/max`` over every data-parallel share | every rank |
| shutdown | :meth:`close`: stops the worker | no |

Rewards are computed on the ranks that ask the teacher (one per data-parallel share: the last pipeline stage's
TP rank 0), each for its own share; the other ranks hold no runner and take part in the collectives only. A
failure follows the teacher's path: the error is shared by :func:`~megatron_gkd.parallel.comm.agree`, the update
raises, and the trainer keeps the last complete step (``RunCheckpoints.save_after_failure``); no step is trained
on a missing reward. Without ``reward.kind`` nothing here runs and no collective is added.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_gkd.parallel.comm import agree, all_gather_msgpack
from megatron_gkd.rewards import RewardBatch, RewardOutput, RewardRunner
from megatron_gkd.trainer.batch import rank_samples, share_rows
from megatron_gkd.trainer.eval import record_fields, response_text

logger = logging.getLogger(__name__)


class RewardsFailed(Exception):
    """A round's rewards failed on some rank (``error``: this rank's :meth:`RewardExchange.receive` error; every rank
    raises it alike)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


REWARDS = "rewards"
"""The rewards' name among a batch's annotations."""


class RewardExchange:
    """Sends each batch's rewards to the runner and shares their outcome over the ranks (an
    :class:`~megatron_gkd.trainer.annotations.Annotator` named ``rewards``).

    Args:
        enabled: rewards are computed in this run (``reward.kind`` is set; the same on every rank).
        runner: this rank's :class:`~megatron_gkd.rewards.RewardRunner`, or None on the ranks that compute none.
        tokenizer: the student's tokenizer (prompts and responses are rewarded as text).
        stop_token_ids: ids that end a response; stripped before decoding, as the evaluator does.
        control: a gloo group over every rank.
        timers: the trainer's phase timers.
    """

    name = REWARDS

    def __init__(self, *, enabled: bool, runner: RewardRunner | None, tokenizer, stop_token_ids: Sequence[int],
                 control, timers):
        assert runner is None or enabled
        self.enabled, self.runner, self.tokenizer, self.control, self.timers = enabled, runner, tokenizer, control, timers
        self._stop = set(stop_token_ids)
        if enabled:
            logger.info("rewards are computed and logged (reward/*)")

    def wait_ready(self) -> None:
        """Collective: returns when every rank's worker has built the reward, else raises on every rank."""
        if not self.enabled:
            return
        error = None
        if self.runner is not None:
            try:
                self.runner.wait_ready()
            except Exception as caught:  # noqa: BLE001 - shared with every rank below
                error = caught
        agree(error, self.control)

    def batch(self, samples, records: dict) -> RewardBatch:
        """``samples`` as text (``records``: each prompt's record by its dataset row)."""
        prompts, responses, fields = [], [], []
        for sample in samples:
            ids = sample.tokens.tolist()
            prompts.append(self.tokenizer.decode(ids[:sample.prompt_len], skip_special_tokens=True))
            responses.append(response_text(self.tokenizer, ids[sample.prompt_len:], self._stop))  # as the eval reads it
            fields.append(records[sample.prompt_index])
        return RewardBatch(prompts, responses, fields)

    def send(self, samples, records: dict, *, index: int | None = None,
             background: bool = False) -> concurrent.futures.Future | None:
        """The rewards of ``samples`` as a Future, computed while the caller goes on (in the reward worker, whatever the
        thread: ``index`` and ``background`` change nothing); None on a rank without a runner. ``records``:
        ``{dataset row: {"index": ..., "answer": ..., "group": ...}}``."""
        if self.runner is None:
            return None
        return self.runner.submit(self.batch(samples, records))

    def known(self, values: Sequence[float]) -> concurrent.futures.Future | None:
        """Rewards already computed (``rl.dynamic_sampling`` needs them before the batch is made) as :meth:`send`'s
        Future, answered at once: None on a rank without a runner, as :meth:`send`."""
        if self.runner is None:
            return None
        future = concurrent.futures.Future()
        future.set_result(RewardOutput(list(values), 0.0, 0.0))
        return future

    def gather(self, values: list[float] | None, rows: Sequence[Sequence[int]], share: int) -> list[float]:
        """Collective over every rank: each sample's reward of the whole batch, on every rank.

        Args:
            values: this rank's rewards (:meth:`receive`), or None on a rank without a runner.
            rows: the batch's rows of each data-parallel share, in the order its rewards were computed.
            share: this rank's data-parallel share.
        """
        found: dict[int, list[float]] = {}
        for item in all_gather_msgpack(None if values is None else [share, list(values)], self.control):
            if item is not None:
                found[item[0]] = item[1]
        assert sorted(found) == list(range(len(rows))), f"rewards of shares {sorted(found)} of {len(rows)}"
        rewards = [0.0] * sum(len(indices) for indices in rows)
        for share_index, indices in enumerate(rows):
            assert len(found[share_index]) == len(indices), "a share's rewards do not match its samples"
            for row, value in zip(indices, found[share_index]):
                rewards[row] = value
        return rewards

    def receive(self, future: concurrent.futures.Future | None) -> list[float] | None:
        """Collective when rewards are on: this rank's rewards (None on a rank without a runner); raises on every
        rank when any rank's rewards failed (the failing rank's :class:`RewardFailed` names the reward and record)."""
        if not self.enabled:
            return None
        values, error = None, None
        with self.timers("reward_wait"):
            if future is not None:
                try:
                    values = future.result().values
                except Exception as caught:  # noqa: BLE001 - shared with every rank below
                    error = caught
            elif self.runner is not None:
                error = RuntimeError("a batch reached its update without its rewards (an internal error)")
            agree(error, self.control)
        return values

    def everyone(self, rollout, records, state) -> list[float]:
        """Every sample's reward of ``rollout`` (the samples of ``records``) on every rank: each data-parallel share's
        computed by its reward worker, waited for and gathered (collective over every rank).

        Raises:
            RewardsFailed: on every rank, where any rank's rewards failed.
        """
        prompt_indices = [record.index for record in records]
        samples = rank_samples(rollout, state, prompt_indices, [record.group for record in records])
        future = self.send(samples, {record.index: record_fields(record) for record in records})
        try:
            values = self.receive(future)
        except Exception as error:  # noqa: BLE001 - raised on every rank alike (receive agrees); kept for the update
            raise RewardsFailed(error) from error
        rows = [share_rows(rollout, len(records), state.data_parallel_size, share)
                for share in range(state.data_parallel_size)]
        return self.gather(values, rows, state.dp_rank)

    def metrics(self, values: list[float] | None, samples: Sequence | None = None) -> dict[str, float]:
        """``reward/mean``, ``reward/min``, ``reward/max`` over every rank's rewards (collective when rewards are on)
        and, where ``samples`` (the rewarded samples; a prompt group's samples on one rank) hold groups of more than one
        sample, ``reward/informative_groups``: the fraction of prompt groups whose rewards differ, the only groups from
        which a group baseline (GRPO, RLOO, Dr. GRPO) learns anything."""
        if not self.enabled:
            return {}
        values = values or []
        groups = None if samples is None else [sample.group for sample in samples]
        by_group: dict[int, set[float]] = {}
        for group, value in zip(groups or [], values):
            by_group.setdefault(group, set()).add(value)
        several = groups is not None and len(by_group) < len(values)
        informative = sum(len(found) > 1 for found in by_group.values()) if several else 0
        # [sum, count, groups, informative groups, -min, max]: one MAX-reduce cannot sum, so two reductions.
        sums = torch.tensor([sum(values), float(len(values)), float(len(by_group) if several else 0), float(informative)],
                            dtype=torch.float64)
        extremes = torch.tensor([-min(values, default=float("inf")), max(values, default=float("-inf"))],
                                dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(self.control) > 1:
            dist.all_reduce(sums, group=self.control)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.control)
        count = float(sums[1])
        assert count > 0, "rewards are on but no rank computed any"
        result = {"reward/mean": float(sums[0]) / count, "reward/min": -float(extremes[0]),
                  "reward/max": float(extremes[1]), "reward/count": count}
        if sums[2] > 0:
            result["reward/informative_groups"] = float(sums[3] / sums[2])
        return result

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
