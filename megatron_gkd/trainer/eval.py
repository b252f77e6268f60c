"""Held-out evaluation: greedy answers through the rollout engine, scored by a registered scorer, and a
task-independent distillation metric, the forward KL to the teacher on those answers (:class:`TeacherKL`).

Scorers are ``score(response_text, answer) -> float in [0, 1]``; register more with
``SCORERS.register("name", fn)`` and choose one with ``eval.scorer``.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Sequence

from megatron_gkd import parallel
from megatron_gkd.parallel.comm import broadcast_msgpack
from megatron_gkd.registry import Registry
from megatron_gkd.rewards.answers import final_answer
from megatron_gkd.rollout import SamplingConfig

logger = logging.getLogger(__name__)

SCORERS: Registry[Callable[[str, str], float]] = Registry("eval scorer", config_key="eval.scorer")


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@SCORERS.register("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1 when the response equals the answer up to surrounding and repeated whitespace."""
    return float(_normalize(response) == _normalize(answer))


# The demo's scorer is the ``final_answer`` reward's own function: an eval's accuracy and a training reward agree.
SCORERS.register("final_answer", final_answer)


def response_text(tokenizer, ids, stop_ids) -> str:
    """A response's text as a scorer reads it: trailing stop ids dropped, special tokens skipped."""
    ids, stop = list(ids), set(stop_ids)
    while ids and ids[-1] in stop:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


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
        self.scorer = SCORERS.get(config.scorer)
        self.sampling = SamplingConfig(temperature=0.0, max_tokens=config.max_tokens,
                                       stop_token_ids=tuple(stop_token_ids), seed=0)
        self._stop = tuple(stop_token_ids)

    def run(self) -> dict[str, float]:
        records = [self.dataset[i] for i in range(len(self.dataset))]
        rollout = self._generate([list(r.prompt_ids) for r in records], self.sampling)
        metrics = {"eval/response_length": float(rollout.response_lengths.float().mean()),
                   "eval/num_prompts": float(len(records))}
        scored = [(response_text(self.tokenizer, rollout.response(i), self._stop), record.answer)
                  for i, record in enumerate(records)]
        with_answers = [(text, answer) for text, answer in scored if answer is not None]
        if with_answers:
            metrics["eval/accuracy"] = sum(self.scorer(text, answer) for text, answer in with_answers) / len(with_answers)
        groups: dict[str, list[float]] = {}  # per data.group_key value (e.g. per task)
        for record, (text, answer) in zip(records, scored):
            if record.group is not None and answer is not None:
                groups.setdefault(record.group, []).append(self.scorer(text, answer))
        for group, scores in sorted(groups.items()):
            metrics[f"eval/accuracy/{group}"] = sum(scores) / len(scores)
        for record, (text, answer) in zip(records[:2], scored[:2]):
            logger.info("eval example: %r -> %r (answer %r)", self.tokenizer.decode(list(record.prompt_ids)[-32:]),
                        text[:200], answer)
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
        specs: the KL's :class:`~megatron_gkd.trainer.step.LossSpec` per teacher.
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
