"""GKD's mixture in the batch path (``sample_mix``; :mod:`megatron_gkd.config.sample_mix`): which source each prompt
of a batch takes its responses from, the off-policy parts as rollout batches, and one batch of them all.

The functions are pure code, no collectives; :class:`Mixture` is the batch path's side of it
(:class:`~megatron_gkd.trainer.flow.BatchFlow` asks it for a batch's sources, its off-policy parts and its metrics,
and asks the rollout engine for the student's part): the one rank that asks the teacher to write responses and
shares them is a collective over every rank. Every rank draws the same sources: the draw is a function of
``(seed, step)`` alone (a numpy generator seeded with both, never the global RNG), so a resumed run draws what the
first one did.

A merged batch keeps the contract of a rollout batch: sample rows ordered by prompt, group id = the prompt's position
in the batch. The teacher writes ``rollout.n`` responses per prompt, as the student samples; the dataset has one
response per prompt (its record's), so a dataset prompt brings one sample.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd.config.checks import generating_teacher
from megatron_gkd.parallel.comm import agree, broadcast_msgpack
from megatron_gkd.rollout.sources import RESPONSE_SOURCES, SourceContext
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import GenerateBatch
from megatron_gkd.trainer.eval import Scorer
from megatron_gkd.trainer.teacher_exchange import TeacherFailed

STUDENT = "student"
"""The on-policy source: the student's own samples through the rollout engine."""


def draw_sources(mix, *, seed: int, step: int, num_prompts: int) -> list[str]:
    """Each prompt's source at batch ``step``: ``student`` with probability ``mix.lmbda_at(step)``, else
    ``mix.source``; one draw for the whole batch (``mix.per=batch``) or one per prompt (``prompt``).

    Args:
        mix: the run's :class:`~megatron_gkd.config.sample_mix.SampleMixConfig` (enabled).
        seed: the draws' seed (``sample_mix.seed`` or ``trainer.seed``).
        step: the batch index.
        num_prompts: prompts of the batch.
    """
    lmbda = mix.lmbda_at(step)
    generator = np.random.default_rng([seed, step])  # keyed on (seed, step): independent of what ran before
    draws = generator.random(1 if mix.per == "batch" else num_prompts)  # uniform in [0, 1): lmbda 1 always draws
    if mix.per == "batch":
        draws = np.repeat(draws, num_prompts)
    return [STUDENT if value < lmbda else mix.source for value in draws]


def merge_by_prompt(parts: Sequence[tuple[Sequence[int], RolloutBatch]], version: int, pad_id: int) -> RolloutBatch:
    """One batch of every part's samples, ordered by prompt position (each part's own order kept within a prompt).

    Args:
        parts: ``(positions, batch)``: group ``g`` of ``batch`` answers the prompt at ``positions[g]`` of the step
            (None: the group is left out).
        version: the weight version of the merged batch (the student's, which sampled what is on-policy).
        pad_id: padding id.
    """
    rows = []  # (position, part, row)
    for part, (positions, batch) in enumerate(parts):
        rows += [(int(positions[int(batch.group_ids[i])]), part, i) for i in range(batch.num_samples)
                 if positions[int(batch.group_ids[i])] is not None]
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    topk_width = max((batch.topk_ids.shape[-1] for _, batch in parts if batch.topk_ids is not None), default=0)
    prompts, responses, logprobs, groups, reasons, topk = [], [], [], [], [], []
    for position, part, i in rows:
        batch = parts[part][1]
        prompts.append(batch.prompt(i))
        responses.append(batch.response(i))
        logprobs.append(batch.logprobs(i).tolist())
        groups.append(position)
        reasons.append(batch.finish_reasons[i])
        topk.append(batch.topk(i).tolist() if batch.topk_ids is not None else [])
    return RolloutBatch.from_samples(prompts, responses, logprobs, groups, reasons, version,
                                     topk=topk if topk_width else None, pad_token_id=pad_id)


def sample_scores(rollout: RolloutBatch, answers: Sequence[str | None] | None,
                  score: Callable[[list[int], list[int], str], float]) -> list[float | None] | None:
    """Each sample's ``score(prompt_ids, response_ids, answer)`` against its prompt's answer (None where the prompt
    has none); None when no prompt has one."""
    if not answers or all(answer is None for answer in answers):
        return None
    found = [answers[int(group)] for group in rollout.group_ids]
    return [None if answer is None else score(rollout.prompt(i), rollout.response(i), answer)
            for i, answer in enumerate(found)]


def source_metrics(rollout: RolloutBatch, sources: Sequence[str], off_policy: str, lmbda: float,
                   scores: Sequence[float | None] | None = None) -> dict[str, float]:
    """``mix/*`` of a step's global batch: the scheduled ``lmbda``, the student's share of the samples and each
    source's samples and response tokens (both sources every step, 0 where one brought nothing).

    ``scores``: each sample's score against its prompt's answer (``eval.scorer``; None where the prompt has no
    answer). With them, ``mix/accuracy/<source>`` is the mean score of the source's scored samples (absent for a
    source with none this step): how good the responses the student learns from are, source by source.
    """
    lengths = rollout.response_lengths
    metrics = {"mix/lmbda": float(lmbda)}
    counts = {}
    for source in (STUDENT, off_policy):
        mine = [i for i in range(rollout.num_samples) if sources[int(rollout.group_ids[i])] == source]
        counts[source] = len(mine)
        metrics[f"mix/samples/{source}"] = float(len(mine))
        metrics[f"mix/tokens/{source}"] = float(lengths[mine].sum()) if mine else 0.0
        scored = [scores[i] for i in mine if scores is not None and scores[i] is not None]
        if scored:
            metrics[f"mix/accuracy/{source}"] = sum(scored) / len(scored)
    metrics["mix/student_fraction"] = counts[STUDENT] / max(rollout.num_samples, 1)
    return metrics


class Mixture:
    """GKD's mixture of a run (``sample_mix``) as the batch path uses it: each prompt's source in a batch, the
    off-policy parts of its responses (the records' own, or written by the teacher now) and the ``mix/*`` metrics.

    Args:
        config: the run's config (``sample_mix`` enabled).
        state: the parallel state.
        control: a gloo group over every rank.
        teachers: the run's :class:`~megatron_gkd.trainer.teachers.Teachers` (the one that writes responses).
        asks_teacher: whether this rank asks the teacher (the exchange's teacher rank).
        tokenizer, stop_ids: the student's tokenizer and the ids that end a response.
        timers: the trainer's phase timers (``teacher_generate``).
        pad_id: the student's padding id.

    Collective over every rank when the teacher writes responses (which rank asks it is agreed here).
    """

    def __init__(self, config, state, *, control, teachers, asks_teacher: bool, tokenizer, stop_ids, timers, pad_id: int):
        self.config, self.mix, self.control, self.teachers = config, config.sample_mix, control, teachers
        self.stop_ids, self.timers, self.pad_id = tuple(stop_ids), timers, pad_id
        self.rank = dist.get_rank()
        # mix/accuracy/<source> scores answers as the eval does
        self._scorer = Scorer(config.eval, tokenizer, self.stop_ids)
        self.generator = generating_teacher(config)  # the teacher that writes responses, or None
        if self.generator is not None:
            # One rank asks for every teacher-written response of a batch (the teacher rank of the first data-parallel
            # share): the responses then do not depend on the layout. Collective over every rank.
            asker = torch.tensor([self.rank if asks_teacher and state.dp_rank == 0 else -1])
            dist.all_reduce(asker, op=dist.ReduceOp.MAX, group=control)
            self._generator_rank = int(asker)

    @property
    def source(self) -> str:
        """Where the off-policy responses come from (a registered response source, :mod:`megatron_gkd.rollout.sources`)."""
        return self.mix.source

    def sources(self, index: int, num_prompts: int) -> list[str]:
        """Each prompt's source in batch ``index`` (the same on every rank)."""
        seed = self.mix.seed if self.mix.seed is not None else self.config.trainer.seed
        return draw_sources(self.mix, seed=seed, step=index, num_prompts=num_prompts)

    def off_policy_parts(self, records, sources: list[str], version: int, seed: int | None) -> list:
        """``(positions, batch)`` of the prompts whose responses are not the student's, from the registered source
        (the teacher asked with ``seed`` where it writes them; collective over every rank when the batch has any)."""
        off = [i for i in range(len(records)) if sources[i] != STUDENT]
        if not off:
            return []

        def write(prompts: list[list[int]]) -> list[list[int]]:
            with self.timers("teacher_generate"):
                return self.teacher_responses(prompts, seed)

        context = SourceContext(version=version, pad_id=self.pad_id, num_samples=self.config.rollout.n,
                                stop_ids=self.stop_ids, write=write if self.generator is not None else None)
        return [(off, RESPONSE_SOURCES.get(self.source)([records[i] for i in off], context))]

    def teacher_responses(self, prompts: list[list[int]], seed: int | None) -> list[list[int]]:
        """The teacher's ``rollout.n`` responses to each of ``prompts`` (prompt by prompt), with its own sampling
        settings (``sample_mix.teacher.*``) and ``seed`` (the batch's, like the rollout's). One rank asks, every rank
        gets them; every rank stops if the request failed. Collective over every rank."""
        settings, responses, error = self.mix.teacher, None, None
        if self.rank == self._generator_rank:
            try:
                batch = GenerateBatch(prompts=[np.asarray(p, dtype=np.int64) for p in prompts],
                                      num_samples=self.config.rollout.n, temperature=settings.temperature,
                                      top_p=settings.top_p, top_k=settings.top_k,
                                      max_tokens=settings.max_tokens or self.config.rollout.max_tokens,
                                      stop_ids=self.stop_ids, seed=seed)
                client = self.teachers.by_name[self.generator].client
                responses = [sample.response_ids.tolist() for sample in client.generate(batch)]
            except Exception as caught:  # noqa: BLE001 - shared with every rank below
                error = caught if not self.teachers.several else TeacherFailed(self.generator, caught)
        agree(error, self.control)
        return broadcast_msgpack(responses, self._generator_rank, self.control)

    def metrics(self, rollout: RolloutBatch, index: int, sources: list[str], answers) -> dict:
        """``mix/*`` of batch ``index``'s global batch (:func:`source_metrics`), its samples scored as the eval scores."""
        return source_metrics(rollout, sources, self.mix.source, self.mix.lmbda_at(index),
                              sample_scores(rollout, answers, self._score))

    def _score(self, prompt: list[int], response: list[int], answer: str) -> float:
        """One response's score against its prompt's answer with ``eval.scorer``, as the eval reads an answer."""
        return self._scorer([prompt], [response], [{"answer": answer}])[0]
