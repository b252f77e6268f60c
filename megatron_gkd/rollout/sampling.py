"""The sampling policy of engines that pick tokens themselves (the ``hf`` rollout engine; the ``hf`` and ``megatron``
teacher backends through :mod:`megatron_gkd.teacher.protocol.sampling`).

One function picks the next token of every row from its scores: scores divided by the temperature, cut to the
``top_k`` most likely ids, then to the smallest set whose probability reaches ``top_p``, renormalised (vLLM's order:
temperature, top-k, top-p). Temperature 0 is the arg-max (ties to the lowest column). Every row draws from its own
``torch.Generator``, so a seeded sample repeats whatever other rows run beside it (up to float ties of padded batches):
a row's ``t``-th token takes the ``t``-th float64 uniform of its stream (:func:`draw_uniforms` draws a response's worth
at once).
"""

from __future__ import annotations

from typing import Sequence

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


def draw_uniforms(generators: list[torch.Generator], count: int) -> torch.Tensor:
    """``[len(generators), count]`` float64 uniforms in ``[0, 1)``: row ``r`` holds the next ``count`` of generator
    ``r``'s stream (the same values as ``count`` draws of one, so a response's worth is one call a row)."""
    if not generators:
        return torch.empty(0, count, dtype=torch.float64)
    return torch.stack([torch.rand(count, dtype=torch.float64, generator=generator) for generator in generators])


def seeded_uniforms(seeds: Sequence[int | None], count: int) -> torch.Tensor:
    """``[len(seeds), count]`` float64 uniforms in ``[0, 1)``: row ``r`` holds the first ``count`` of the stream
    :func:`seeded_generator` gives ``seeds[r]``, as :func:`draw_uniforms` of those generators would.

    One generator is re-seeded row after row instead of one held per row: a host generator holds 2.7 KB, so a
    request of a million one-token responses held 2.7 GB of generators (issue #48); this holds the uniforms only.
    """
    uniforms = torch.empty(len(seeds), count, dtype=torch.float64)
    generator = torch.Generator()
    for row, seed in enumerate(seeds):
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        torch.rand(count, dtype=torch.float64, generator=generator, out=uniforms[row])
    return uniforms


def sample_next(scores: torch.Tensor, uniforms: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """The column picked in each row of ``scores``.

    The draw inverts the cumulative distribution of the renormalised row laid out in id order at the row's uniform.
    As the layout is the ids', not the columns', a backend that holds only its top-k columns in order of probability
    (the megatron teacher) picks the same id as one that holds the whole row in id order (the hf backend and engine).
    One uniform a row, and no sort of the row unless a ``top_p`` nucleus spans more than its top 16,384 columns: at
    151,936 ids and 16 rows, 4 ms a token, against 58 ms for ``torch.multinomial`` (an exponential per id) and
    170-180 ms for the sorted draw this one replaced; with ``top_p=0.9`` 47 ms against 170 ms
    (``benchmarks/sampling.py``).

    Args:
        scores: ``[b, V']`` logits or log-probs of the next token (any shift per row gives the same samples), on the
            host; ``-inf`` marks columns that cannot be picked.
        uniforms: ``[b]`` float64 in ``[0, 1)``, one per row (the row's stream's next: :func:`draw_uniforms`).
        temperature: 0 is greedy (the uniforms are not used).
        top_k: keep the ``top_k`` most likely columns; 0 keeps all.
        top_p: keep the smallest set of the most likely columns whose mass reaches ``top_p``; 1 keeps all.
        ids: ``[b, V']`` the token id of each column; None when column ``c`` is id ``c``.
        vocab: the number of token ids; ``V'`` when None.

    Returns:
        ``[b]`` int64 column indices into ``scores``.
    """
    assert uniforms.shape == scores.shape[:1], (uniforms.shape, scores.shape)
    scores = scores.float()
    if temperature == 0:
        return scores.argmax(dim=-1)  # the first maximum: the lowest column among ties
    scores, width = scores / temperature, scores.shape[-1]
    kept = None  # [b, k]: the columns still in the running, when a cut dropped some
    if 0 < top_k < width:
        scores, kept = torch.topk(scores, top_k, dim=-1, sorted=top_p < 1.0)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float64)
    elif top_p < 1.0:
        scores, kept, probs = _nucleus_candidates(scores, top_p)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float64)
    if top_p < 1.0:
        # Keep an entry while the mass before it is below top_p: the first one always stays.
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    if kept is not None:
        ids = kept if ids is None else ids.gather(1, kept)
    layout = None  # [b, w]: the column of each entry of the id-ordered row, when it is not the identity
    if ids is not None:
        if ids.shape[-1] * 8 < (width if vocab is None else vocab):  # a few columns: put them in id order
            ids, layout = ids.sort(dim=-1)
            probs = probs.gather(1, layout)
        else:  # most of the vocabulary: spread the columns over it; the ids no column holds have no mass
            probs = probs.new_zeros(probs.shape[0], width if vocab is None else vocab).scatter_(1, ids, probs)
    # Either layout cumulates the same masses in the same order (a massless id adds an exact zero).
    cdf = probs.cumsum(dim=-1)
    # The first entry whose cumulative mass passes the uniform: a massless one never does (its mass equals the one's
    # before it), and the uniform is below 1, so the clamp only guards rounding.
    picked = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)  # [b, 1]
    if layout is not None:
        columns = layout.gather(1, picked)[:, 0]
    elif ids is not None:
        columns = (ids == picked).int().argmax(dim=-1)  # the column that holds the picked id
    else:
        columns = picked[:, 0]
    return columns if kept is None else kept.gather(1, columns[:, None])[:, 0]


NUCLEUS_WIDTHS = (1024, 16384)  # the most likely columns tried, in turn, before a sort of the whole row


def _nucleus_candidates(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The most likely columns of each row, most likely first, enough to hold every row's nucleus: ``(scores,
    columns, probabilities over the whole row)``, all ``[b, w]``.

    A trained model's nucleus is a few hundred of its 150k ids: the top 1,024 (``topk``, 1.5 ms for 16 rows of 152k)
    usually hold it, where a sort of the row costs 120 ms. When some row's top ``w`` hold less than ``top_p`` of its
    mass, the next width is tried, and the whole row is sorted last (a flat row: a random model's).
    """
    width = scores.shape[-1]
    lse = torch.logsumexp(scores.double(), dim=-1, keepdim=True)
    for candidates in NUCLEUS_WIDTHS:
        if candidates >= width:
            break
        top, columns = torch.topk(scores, candidates, dim=-1)
        probs = torch.exp(top.double() - lse)
        if bool((probs.sum(dim=-1) >= top_p).all()):  # every row's nucleus closes inside these columns
            return top, columns, probs
    top, columns = torch.sort(scores, dim=-1, descending=True, stable=True)
    return top, columns, torch.exp(top.double() - lse)
