"""Held-out evaluation: greedy answers through the rollout engine, scored by ``eval.scorer``, and a
task-independent distillation metric, the forward KL to the teacher on those answers (:class:`TeacherKL`).

``eval.scorer`` is a reward kind (:data:`~megatron_gkd.rewards.kinds.REWARDS`) built from the ``eval`` section's
options, so an eval's accuracy and a training reward of the same kind and options agree on every response
(:class:`Scorer`); register more kinds there (``REWARDS.register("name", "module:Class")``).
"""

from __future__ import annotations

import logging
from typing import Sequence

from megatron_gkd import parallel
from megatron_gkd.parallel.comm import broadcast_msgpack
from megatron_gkd.rewards.kinds import REWARDS
from megatron_gkd.rewards.protocol import plain
from megatron_gkd.rewards.runner import RewardBatch, check_values
from megatron_gkd.rollout import SamplingConfig

logger = logging.getLogger(__name__)


def response_text(tokenizer, ids, stop_ids) -> str:
    """A response's text as a scorer reads it: trailing stop ids dropped, special tokens skipped."""
    ids, stop = list(ids), set(stop_ids)
    while ids and ids[-1] in stop:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


def record_fields(record) -> dict:
    """A :class:`~megatron_gkd.data.PromptRecord` as a reward or a scorer reads it."""
    return {"index": record.index, "answer": record.answer, "group": record.group}


class Scorer:
    """``eval.scorer`` in this process: the reward kind of that name built from the ``eval`` section, called on
    text decoded as the rewards decode it. Its values are checked as a reward worker's are (one finite number per
    response; :class:`~megatron_gkd.rewards.runner.RewardFailed` names the record otherwise).

    Args:
        config: the ``eval`` section (the kind and its options).
        tokenizer: the student's tokenizer.
        stop_token_ids: ids that end a response (dropped before it is decoded).

    Attributes:
        needs: the fields a record must hold to be scored (an ``answer``, for every kind but ``function`` and a
            ``regex`` that does not read one).
    """

    def __init__(self, config, tokenizer, stop_token_ids: Sequence[int]):
        kind = REWARDS.get(config.scorer, config_key="eval.scorer")
        self.kind, self.tokenizer, self._stop = kind(config), tokenizer, tuple(stop_token_ids)
        self.needs = kind.needs_for(config)

    def scorable(self, fields: dict) -> bool:
        """The record holds every field the scorer needs."""
        return all(fields.get(name) is not None for name in self.needs)

    def __call__(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 records: Sequence[dict]) -> list[float]:
        """The scores of ``responses`` (token ids) to ``prompts`` with their records' fields, in order."""
        batch = RewardBatch([self.tokenizer.decode(list(ids), skip_special_tokens=True) for ids in prompts],
                            [response_text(self.tokenizer, ids, self._stop) for ids in responses], list(records))
        if not len(batch):
            return []
        return check_values(self.kind.name, plain(self.kind(batch.prompts, batch.responses, batch.records)), batch)


class Evaluator:
    """Runs one evaluation (a collective: every rank calls :meth:`run`).

    Args:
        dataset: the held-out :class:`~megatron_gkd.data.PromptDataset` (with answers for the scorer).
        tokenizer: the student's tokenizer (answers are compared as text).
        generate: ``generate(prompt_ids, sampling) -> RolloutBatch``, the same batch on every rank.
        kl: ``kl(rollout, prompt_indices) -> float | None``, the forward KL to the teacher on the
            responses (a :class:`TeacherKL`), or None when the run has no teacher or ``eval.kl`` is off.
        config: the ``eval`` section.
        stop_token_ids: ids that end an answer (the tokenizer's EOS at least).
    """

    def __init__(self, dataset, tokenizer, generate, kl, config, stop_token_ids: Sequence[int]):
        self.dataset, self.tokenizer, self._generate, self._kl = dataset, tokenizer, generate, kl
        self.scorer = Scorer(config, tokenizer, stop_token_ids)
        self.sampling = SamplingConfig(temperature=0.0, max_tokens=config.max_tokens,
                                       stop_token_ids=tuple(stop_token_ids), seed=0)
        self._stop = tuple(stop_token_ids)

    def run(self) -> dict[str, float]:
        records = [self.dataset[i] for i in range(len(self.dataset))]
        rollout = self._generate([list(r.prompt_ids) for r in records], self.sampling)
        metrics = {"eval/response_length": float(rollout.response_lengths.float().mean()),
                   "eval/num_prompts": float(len(records))}
        fields = [record_fields(record) for record in records]
        rows = [i for i, row in enumerate(fields) if self.scorer.scorable(row)]  # e.g. those with an answer
        values = self.scorer([records[i].prompt_ids for i in rows], [rollout.response(i) for i in rows],
                             [fields[i] for i in rows])
        if rows:
            metrics["eval/accuracy"] = sum(values) / len(values)
        groups: dict[str, list[float]] = {}  # per data.group_key value (e.g. per task)
        for i, value in zip(rows, values):
            if records[i].group is not None:
                groups.setdefault(records[i].group, []).append(value)
        for group, scores in sorted(groups.items()):
            metrics[f"eval/accuracy/{group}"] = sum(scores) / len(scores)
        for i, record in enumerate(records[:2]):
            logger.info("eval example: %r -> %r (answer %r)", self.tokenizer.decode(list(record.prompt_ids)[-32:]),
                        response_text(self.tokenizer, rollout.response(i), self._stop)[:200], record.answer)
        kl = self._kl(rollout, [r.index for r in records]) if self._kl is not None else None
        if kl is not None:
            metrics["eval/kl_to_teacher"] = kl
        return metrics


class TeacherKL:
    """The token-mean forward KL of the student to the teachers on eval answers: on each teacher's top-k, or over
    the whole vocabulary with the hidden signal, in any mode (a collective of every rank; the same value on all).

    Args:
        flow: the run's :class:`~megatron_gkd.trainer.flow.BatchFlow` (teacher requests and micro-batches).
        runner: the :class:`~megatron_gkd.trainer.step.StepRunner` (forward only).
        specs: the KL's :class:`~megatron_gkd.trainer.specs.LossSpec` per teacher.
        groups: each eval prompt's group (``data.group_key``) by dataset index (routes it to its teacher).
        control: a gloo group over every rank.
        source_rank: a last-stage rank (it holds the statistics).
    """

    def __init__(self, flow, runner, specs: dict, groups: dict, control, source_rank: int):
        self.flow, self.runner, self.specs, self.groups = flow, runner, specs, groups
        self.control, self.source_rank = control, source_rank

    def __call__(self, rollout, prompt_indices: list[int]) -> float | None:
        import torch

        if len(prompt_indices) < self.flow.state.data_parallel_size:  # every DP rank needs a share of the prompts
            return None
        batch = self.flow.scoring_batch(rollout, prompt_indices, [self.groups.get(i) for i in prompt_indices])
        microbatches = self.flow.prepare(batch, scoring=True).microbatches
        with parallel.eval_mode(self.runner.chunks), torch.no_grad():
            stats = self.runner.run(self.specs, microbatches, forward_only=True)
        return broadcast_msgpack(stats["loss"] if stats else None, self.source_rank, self.control)
