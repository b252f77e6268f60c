"""Where a batch's responses come from when the student does not sample them: GKD's off-policy sources
(``sample_mix.source``), registered choices with traits.

A source is a function ``(records, context) -> RolloutBatch``: the responses of the prompts in ``records`` (the
dataset's rows, each with ``prompt_ids`` and, where the data has them, ``response_ids`` and ``answer``), as one
batch in the rollout batch's contract (sample rows ordered by prompt, group id = the record's position). The
``context`` (:class:`SourceContext`) brings what the batch path knows: the weight version, the padding id,
``rollout.n`` and the stop ids, and the teacher that writes responses when the source's traits say it needs one.
The config checks ask a source's traits (:class:`SourceTraits`), never its name; a new source is its function
registered here or anywhere before the config is read (``RESPONSE_SOURCES.register(name, fn, traits=...)``), with
no change to the mixture, the flow or the checks (``tests/unit/trainer/test_sample_mix_flow.py`` adds one).

The student's own samples are not a source here: the rollout engine makes them, with probability ``sample_mix.lmbda``
(:mod:`megatron_gkd.trainer.sample_mix`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from megatron_gkd.registry import Registry
from megatron_gkd.rollout.types import RolloutBatch


@dataclasses.dataclass(frozen=True, slots=True)
class SourceTraits:
    """What a response source needs, which the config checks ask."""

    from_records: bool = False
    """The records carry the responses: the data must have them."""
    teacher_writes: bool = False
    """A teacher of the student's tokenizer that can generate writes them (``context.write``), with
    ``sample_mix.teacher.*``; the run needs one."""


@dataclasses.dataclass(frozen=True)
class SourceContext:
    """What a response source is given beside its records.

    Attributes:
        version: the weight version of the batch (the student's, which samples its on-policy part).
        pad_id: the student's padding id.
        num_samples: responses a prompt gets when a model writes them (``rollout.n``).
        stop_ids: ids that end a response.
        write: ``write(prompts) -> responses``: the teacher's ``num_samples`` responses to each prompt, prompt by
            prompt (collective over every rank: every rank calls it with the same prompts); None where no source of
            the run needs it.
    """

    version: int
    pad_id: int
    num_samples: int
    stop_ids: tuple[int, ...] = ()
    write: Callable[[list[list[int]]], list[list[int]]] | None = None


ResponseSource = Callable[[Sequence, SourceContext], RolloutBatch]

RESPONSE_SOURCES: Registry[ResponseSource] = Registry("response source", config_key="sample_mix.source",
                                                      traits=SourceTraits)


def dataset_batch(records, version: int, pad_id: int) -> RolloutBatch:
    """The records' own responses as a batch: one sample per record, group = the record's position."""
    return RolloutBatch.from_samples(
        prompts=[list(r.prompt_ids) for r in records], responses=[list(r.response_ids) for r in records],
        logprobs=[[0.0] * len(r.response_ids) for r in records], group_ids=range(len(records)),
        finish_reasons=["stop"] * len(records), weight_version=version, pad_token_id=pad_id)


def generated_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], num_samples: int,
                    stop_ids: Sequence[int], version: int, pad_id: int) -> RolloutBatch:
    """Responses a model wrote (``num_samples`` per prompt, prompt by prompt, as a generate request returns them)
    as a batch. Their rollout log-probs are 0: no rollout engine sampled them (only the policy gradient reads
    them, and it is refused with a mixture)."""
    assert len(responses) == len(prompts) * num_samples, "the teacher answers every prompt num_samples times"
    groups = [index // num_samples for index in range(len(responses))]
    stops = set(int(i) for i in stop_ids)
    return RolloutBatch.from_samples(
        prompts=[list(prompts[g]) for g in groups], responses=[list(r) for r in responses],
        logprobs=[[0.0] * len(r) for r in responses], group_ids=groups,
        finish_reasons=["stop" if len(r) and int(r[-1]) in stops else "length" for r in responses],
        weight_version=version, pad_token_id=pad_id)


@RESPONSE_SOURCES.register("dataset", traits=SourceTraits(from_records=True))
def records_responses(records, context: SourceContext) -> RolloutBatch:
    """Each record's own response, once (supervised KD; TRL's ``seq_kd=False``)."""
    return dataset_batch(records, context.version, context.pad_id)


@RESPONSE_SOURCES.register("teacher", traits=SourceTraits(teacher_writes=True))
def teacher_responses(records, context: SourceContext) -> RolloutBatch:
    """``rollout.n`` responses to each prompt written by the teacher with ``sample_mix.teacher.*`` (sequence-level
    KD; TRL's ``seq_kd=True``)."""
    prompts = [list(record.prompt_ids) for record in records]
    return generated_batch(prompts, context.write(prompts), context.num_samples, context.stop_ids, context.version,
                           context.pad_id)
