"""The sampling policy of engines that pick tokens themselves (the ``hf`` rollout engine; the ``hf`` and ``megatron``
teacher backends through :mod:`megatron_gkd.teacher.sampling`).

One function picks the next token of every row from its scores: scores divided by the temperature, cut to the
``top_k`` most likely ids, then to the smallest set whose probability reaches ``top_p``, renormalised (vLLM's order:
temperature, top-k, top-p). Temperature 0 is the arg-max (ties to the lowest column). Every row draws from its own
``torch.Generator``, so a seeded sample repeats whatever other rows run beside it (up to float ties of padded batches).
"""

from __future__ import annotations

import torch

from megatron_gkd.rollout.types import SamplingConfig


def seeded_generator(seed: int | None) -> torch.Generator:
    """A host generator seeded with ``seed``, or with fresh entropy of its own when it is None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample_generators(sampling: SamplingConfig, num_prompts: int) -> list[torch.Generator]:
    """One generator per sample in batch order (prompt ``i``'s ``n`` samples are rows ``i*n .. i*n+n-1``), seeded
    ``seed + i*n + j`` as :class:`SamplingConfig` says (vLLM's per-request seeds), or with fresh entropy when
    ``sampling.seed`` is None."""
    seeds = [sampling.prompt_seed(prompt) for prompt in range(num_prompts)]
    return [seeded_generator(None if seed is None else seed + sample) for seed in seeds for sample in range(sampling.n)]


def sample_next(scores: torch.Tensor, generators: list[torch.Generator], *, temperature: float, top_k: int,
                top_p: float) -> torch.Tensor:
    """The column picked in each row of ``scores``.

    Args:
        scores: ``[b, V']`` logits or log-probs of the next token (any shift per row gives the same samples), on the
            host; ``-inf`` marks columns that cannot be picked.
        generators: one per row.
        temperature: 0 is greedy.
        top_k: keep the ``top_k`` most likely columns; 0 keeps all.
        top_p: keep the smallest prefix of the sorted columns whose mass reaches ``top_p``; 1 keeps all.

    Returns:
        ``[b]`` int64 column indices into ``scores``.
    """
    assert len(generators) == scores.shape[0], (len(generators), scores.shape)
    scores = scores.float()
    if temperature == 0:
        return scores.argmax(dim=-1)  # the first maximum: the lowest column among ties
    ordered, order = torch.sort(scores / temperature, dim=-1, descending=True, stable=True)
    if 0 < top_k < ordered.shape[-1]:
        ordered[:, top_k:] = -torch.inf
    probs = torch.softmax(ordered, dim=-1)
    if top_p < 1.0:
        # Keep an entry while the mass before it is below top_p: the first one always stays.
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    # One draw of torch.multinomial(row, 1, generator=g) is argmax(row / q) with q ~ Exp(1) drawn from g (ATen's
    # algorithm; tests/unit/rollout/test_sampling.py checks that the two agree): the same tokens, and a row costs one
    # exponential_ instead of multinomial's checks (10 against 25 us, a quarter of a tiny model's decode step).
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        row.exponential_(1.0, generator=generator)
    picks = (probs / noise).argmax(dim=-1)
    return order.gather(1, picks[:, None])[:, 0]
