"""A teacher cache of teacher-WRITTEN responses: sequence-level KD (``sample_mix.source=teacher`` with ``lmbda`` 0 at
every step) served from files with no teacher running.

The build asks the teacher's ``generate`` for ``num_per_prompt`` responses to each prompt of the dataset, with the
run's ``sample_mix.teacher.*`` settings, and stores each prompt + response with the teacher's scores of it (asked in
the same round trip with the top-k signal, ``score_top_k``; scored right after with the hidden signal), in the
shard format of :mod:`.store`. The trainer then asks the cache's ``generate`` for a batch's responses and its
``score`` for their rows, as it asks a live teacher.

Seeds (recorded in the manifest's ``generation``): the build sends ``prompts_per_request`` prompts per request, in the
dataset's order, and request ``r`` (counted over the whole build) carries seed ``seed + r * SEED_STRIDE``, as the
trainer seeds its batch ``r`` (``rollout.seed + r * 1_000_003``). So with ``data.shuffle=false`` and
``prompts_per_request`` = the run's prompts per step, the cache holds what the live teacher writes in the run's first
epoch, sample for sample; and a resumed build sends the same requests, so it writes the same bytes.

Serving ``num_samples`` of the ``num_per_prompt`` responses (:func:`pick_responses`): all of them in the order the
teacher wrote them when ``num_samples == num_per_prompt`` (or the request has no seed: the first ``num_samples``);
otherwise ``num_samples`` distinct ones drawn by ``numpy.random.default_rng([seed, i])`` for the request's prompt
``i`` (as the teacher draws sample ``j`` of prompt ``i`` from ``(seed, i, j)``), kept in their stored order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_gkd.teacher.cache.store import CacheManifest, CacheRecord
from megatron_gkd.teacher.protocol.types import GenerateBatch, ScoreBatch, SequenceRequest, Signal, TeacherOutput

SEED_STRIDE = 1_000_003
"""Between the seeds of two consecutive requests (the trainer's stride between two batches, trainer/flow.py)."""
SAMPLING_KEYS = {"temperature": "sample_mix.teacher.temperature", "top_p": "sample_mix.teacher.top_p",
                 "top_k": "sample_mix.teacher.top_k", "max_tokens": "sample_mix.teacher.max_tokens",
                 "stop_ids": "rollout.stop_token_ids"}
"""The settings a request must share with the cache (they shape the distribution the responses are drawn from), and
the run's key for each (``stop_ids``: ``rollout.stop_token_ids`` and the tokenizer's EOS)."""
REBUILD_FLAG = "--responses-per-prompt"


def prompt_records(dataset) -> list[CacheRecord]:
    """The prompts of a :class:`~megatron_gkd.data.PromptDataset` as records without a response (``response_start``
    = the prompt's length): what a generation cache's dataset digest covers."""
    records = []
    for position in range(len(dataset)):
        record = dataset[position]
        records.append(CacheRecord(index=record.index, token_ids=np.asarray(record.prompt_ids, dtype=np.int64),
                                   response_start=len(record.prompt_ids)))
    return records


def sampling_settings(settings, max_tokens: int, stop_ids: Sequence[int]) -> dict:
    """A run's settings for teacher-written responses, keyed as :data:`SAMPLING_KEYS`: ``settings`` is its
    ``sample_mix.teacher`` section, ``max_tokens`` the longest response (``config.checks.teacher_response_limit``),
    ``stop_ids`` its stop ids with the tokenizer's EOS."""
    return {"temperature": float(settings.temperature), "top_p": float(settings.top_p), "top_k": int(settings.top_k),
            "max_tokens": int(max_tokens), "stop_ids": sorted(int(i) for i in stop_ids)}


def generation_settings(settings, max_tokens: int, stop_ids: Sequence[int], *, num_per_prompt: int,
                        prompts_per_request: int, seed: int) -> dict:
    """What a generation cache's manifest records of how the teacher wrote its responses.

    Raises:
        ValueError: a count below 1 or a negative seed.
    """
    if num_per_prompt < 1 or prompts_per_request < 1:
        raise ValueError(f"{REBUILD_FLAG}={num_per_prompt} and --batch-size={prompts_per_request} (prompts per "
                         "generate request) must be >= 1")
    if seed < 0:
        raise ValueError(f"the generation seed {seed} (rollout.seed) must be >= 0")
    return dict(sampling_settings(settings, max_tokens, stop_ids), num_per_prompt=num_per_prompt, seed=seed,
                prompts_per_request=prompts_per_request)


def setting_differences(generation: dict, asked: dict) -> list[str]:
    """``"setting: X in the cache, Y asked"`` for each sampling setting of :data:`SAMPLING_KEYS` in which a request
    differs from the cache (stop ids in any order)."""
    asked = dict(asked, stop_ids=sorted(asked["stop_ids"]))
    return [f"{key}: {generation[key]!r} in the cache, {asked[key]!r} asked" for key in SAMPLING_KEYS
            if generation[key] != asked[key]]


def pick_responses(num_stored: int, num_samples: int, seed: int | None, position: int) -> list[int]:
    """Which of a prompt's ``num_stored`` responses answer a request for ``num_samples`` (module docstring)."""
    assert num_samples <= num_stored
    if num_samples == num_stored or seed is None:
        return list(range(num_samples))
    drawn = np.random.default_rng([seed, position]).choice(num_stored, size=num_samples, replace=False)
    return sorted(int(i) for i in drawn)


def write_responses(client, prompts: Sequence[CacheRecord], plan: CacheManifest, *,
                    first_request: int) -> tuple[list[CacheRecord], list[TeacherOutput]]:
    """The teacher's responses to ``prompts`` (one shard's) as prompt + response records, with their scores.

    Args:
        client: a teacher client that generates (``generate_async``, ``score_async``).
        prompts: the prompts, as :func:`prompt_records` gives them.
        plan: the build's manifest (``generation`` set).
        first_request: the number of the shard's first request over the whole build (its seed's offset).

    Returns:
        ``num_per_prompt`` records per prompt (prompt by prompt, in the teacher's order) and their outputs.
    """
    generation = plan.generation
    per_request = generation["prompts_per_request"]
    requests = []
    for number, start in enumerate(range(0, len(prompts), per_request)):
        chunk = prompts[start:start + per_request]
        # The top-k rows come in the same round trip; hidden states are asked after (a generate answers top-k only).
        batch = GenerateBatch(prompts=[r.token_ids for r in chunk], num_samples=generation["num_per_prompt"],
                              temperature=generation["temperature"], top_p=generation["top_p"],
                              top_k=generation["top_k"], max_tokens=generation["max_tokens"],
                              stop_ids=tuple(generation["stop_ids"]),
                              seed=generation["seed"] + (first_request + number) * SEED_STRIDE,
                              score_top_k=plan.top_k if Signal(plan.signal).sends_topk else None,
                              score_temperature=plan.temperature)
        requests.append((chunk, batch, client.generate_async(batch)))
    records, outputs = [], []
    for chunk, batch, future in requests:
        samples = future.result()
        written = [CacheRecord(index=chunk[s.prompt_index].index,
                               token_ids=np.concatenate([batch.prompts[s.prompt_index], s.response_ids]),
                               response_start=len(batch.prompts[s.prompt_index])) for s in samples]
        if batch.score_top_k is not None:
            scored = [s.output for s in samples]
        else:  # one score request of the request's responses, as the trainer scores a step's
            sequences = [SequenceRequest(token_ids=r.token_ids, response_start=r.response_start) for r in written]
            scored = client.score(ScoreBatch(sequences=sequences, top_k=1, temperature=plan.temperature,
                                             signal=plan.signal, hidden_dtype=plan.hidden_dtype or "bfloat16"))
        records += written
        outputs += scored
    return records, outputs


def num_requests(num_prompts: int, per_request: int) -> int:
    return -(-num_prompts // per_request)

