"""The teacher's sampling policy for backends that sample themselves (``hf``, ``megatron``).

One function picks the next token of every row from its scores, so both backends sample the same
distribution for the same :class:`~megatron_gkd.teacher.protocol.types.GenerateBatch`: the rollout engines' policy
(:func:`megatron_gkd.rollout.sampling.sample_next`: temperature, then ``top_k``, then ``top_p``; temperature 0 is
the arg-max, ties to the lowest column).

Every response draws from its own ``torch.Generator``, seeded from ``(seed, prompt, sample)``, so a
seeded request repeats whatever rows a backend runs together (up to float ties of padded batches).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gkd.rollout import sampling as rollout_sampling
from megatron_gkd.teacher.protocol.types import GenerateBatch


def row_seeds(batch: GenerateBatch) -> list[int | None]:
    """The seed of each response's stream, in response order (prompt by prompt, ``num_samples`` each):
    63 bits from ``(seed, prompt, sample)``, or None for every response of an unseeded batch."""
    if batch.seed is None:
        return [None] * batch.num_responses
    return [int(np.random.SeedSequence([batch.seed, prompt, sample]).generate_state(1, dtype=np.uint64)[0] >> 1)
            for prompt in range(len(batch.prompts)) for sample in range(batch.num_samples)]


def row_uniforms(batch: GenerateBatch) -> torch.Tensor:
    """``[num_responses, max_tokens]``: response ``r``'s uniform for each of its tokens, from the stream seeded
    with its :func:`row_seeds` (fresh entropy when the batch has no seed)."""
    return rollout_sampling.seeded_uniforms(row_seeds(batch), batch.max_tokens)


def sample_next(scores: torch.Tensor, batch: GenerateBatch, uniforms: torch.Tensor, *,
                ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """The column picked in each row of ``scores``.

    Args:
        scores: ``[b, V']`` logits or log-probs of the next token (any shift per row gives the same
            samples); ``-inf`` marks columns that cannot be picked.
        batch: the sampling parameters.
        uniforms: ``[b]``, each row's uniform for this token (a column of :func:`row_uniforms`).
        ids, vocab: the token id of each column and the number of ids, when the columns are not the ids
            (the megatron backend's top-k rows); the rollout policy's arguments of the same names.

    Returns:
        ``[b]`` int64 column indices into ``scores``.
    """
    return rollout_sampling.sample_next(scores, uniforms, temperature=batch.temperature, top_k=batch.top_k,
                                        top_p=batch.top_p, ids=ids, vocab=vocab)
