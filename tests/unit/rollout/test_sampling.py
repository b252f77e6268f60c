"""The sampling policy of the engines that pick tokens themselves (:mod:`megatron_gkd.rollout.sampling`)."""

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.rollout.sampling import draw_uniforms, sample_generators, sample_next, seeded_uniforms


def _uniforms(seeds):
    """One uniform a row, row ``i`` from a generator seeded ``seeds[i]``."""
    return draw_uniforms([torch.Generator().manual_seed(seed) for seed in seeds], 1)[:, 0]


def _policy(scores, temperature, top_k, top_p):
    """The policy's distribution, written as HF's warpers: the cuts mask ids in place, in float64."""
    scores = scores.double() / temperature
    ordered, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    dropped = torch.zeros_like(ordered, dtype=torch.bool)
    if 0 < top_k < ordered.shape[-1]:
        dropped[:, top_k:] = True
    probs = torch.softmax(ordered.masked_fill(dropped, -torch.inf), dim=-1)
    if top_p < 1.0:
        dropped |= probs.cumsum(dim=-1) - probs >= top_p
    return torch.softmax(scores.masked_fill(dropped.scatter(1, order, dropped), -torch.inf), dim=-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.5)])
def test_the_draws_follow_the_cut_and_renormalised_distribution(temperature, top_k, top_p):
    # 40,000 rows of one 10-id distribution, each with its own seed: the frequencies are the policy's probabilities
    # within 0.01 (four standard errors at most), and a cut or impossible id is never drawn.
    scores = torch.randn(1, 10, generator=torch.Generator().manual_seed(1)) * 1.5
    scores[0, 9] = -torch.inf
    rows = 40_000
    got = sample_next(scores.expand(rows, -1), _uniforms(range(rows)),
                      temperature=temperature, top_k=top_k, top_p=top_p)
    frequencies = torch.bincount(got, minlength=10).double() / rows
    expected = _policy(scores, temperature, top_k, top_p)[0]
    assert (frequencies - expected).abs().max() < 0.01, (frequencies, expected)
    assert (frequencies[expected == 0] == 0).all()


def test_a_rows_uniforms_are_its_generators_stream_whatever_the_count():
    # The hf engine draws a response's worth at once, a partial rollout or a teacher backend may draw fewer: the t-th
    # token of a seeded row takes the same uniform either way.
    whole = draw_uniforms([torch.Generator().manual_seed(s) for s in range(3)], 24)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        one_at_a_time = torch.cat([draw_uniforms([generator], 1)[0] for _ in range(24)])
        assert torch.equal(whole[seed], one_at_a_time)
    assert ((whole >= 0) & (whole < 1)).all() and whole.dtype == torch.float64


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 1.0), (0, 0.8), (20, 0.8)])
def test_the_draw_does_not_depend_on_the_order_of_the_columns(top_k, top_p):
    # The megatron teacher backend samples from its top-k rows (in order of probability), the hf backend from the
    # logits in id order: one seed must pick the same id from both.
    scores = torch.randn(32, 300, generator=torch.Generator().manual_seed(2)) * 3
    order = torch.stack([torch.randperm(300, generator=torch.Generator().manual_seed(row)) for row in range(32)])
    by_id = sample_next(scores, _uniforms(range(32)), temperature=1.0, top_k=top_k,
                        top_p=top_p)
    permuted = sample_next(scores.gather(1, order), _uniforms(range(32)),
                           temperature=1.0, top_k=top_k, top_p=top_p, ids=order)
    assert order.gather(1, permuted[:, None])[:, 0].equal(by_id)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_top_k_columns_alone_pick_what_the_whole_row_picks(top_p):
    # What the megatron teacher backend holds: only the top_k columns, in order of probability, and their ids.
    scores = torch.randn(32, 300, generator=torch.Generator().manual_seed(3)) * 3
    whole = sample_next(scores, _uniforms(range(32)), temperature=0.9, top_k=20,
                        top_p=top_p)
    top, ids = torch.topk(scores, 20, dim=-1)
    columns = sample_next(top, _uniforms(range(32)), temperature=0.9, top_k=20,
                          top_p=top_p, ids=ids, vocab=300)
    assert ids.gather(1, columns[:, None])[:, 0].equal(whole)
    assert not whole.equal(sample_next(scores, _uniforms(range(1, 33)),
                                       temperature=0.9, top_k=20, top_p=top_p))  # the draw is the generators'


def test_greedy_takes_the_lowest_of_tied_columns():
    scores = torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 3.0]])
    assert sample_next(scores, torch.zeros(2, dtype=torch.float64), temperature=0.0, top_k=0, top_p=1.0).tolist() == [1, 0]


def test_generators_are_seeded_per_sample_as_sampling_config_says():
    sampling = SamplingConfig(n=3, seed=10)
    draws = [g.initial_seed() for g in sample_generators(sampling, 2)]
    assert draws == [10, 11, 12, 13, 14, 15]
    unseeded = sample_generators(SamplingConfig(n=2, seed=None), 1)
    assert unseeded[0].initial_seed() != unseeded[1].initial_seed()


def test_the_nucleus_found_among_the_top_columns_is_the_sorted_rows():
    # Peaked rows (a trained model's: the nucleus is a few columns, found among the top 1,024) beside flat ones
    # (a random model's: it takes most of the row, which is then sorted whole): the picks of a full sort.
    scores = torch.randn(24, 5000, generator=torch.Generator().manual_seed(5))
    scores[::2] *= 8
    uniforms = _uniforms(range(24))
    got = sample_next(scores, uniforms, temperature=1.0, top_k=0, top_p=0.9)
    ordered, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    probs = torch.softmax(ordered, dim=-1, dtype=torch.float64)
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= 0.9, 0.0)
    cdf = torch.zeros_like(probs).scatter_(1, order, probs).cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
    assert got.equal(expected)
    nucleus = (probs > 0).sum(dim=-1)
    assert nucleus[::2].max() < 1024 < nucleus[1::2].min()  # both ways of finding it were taken


def test_seeded_uniforms_are_each_seeds_stream_from_one_generator(generators_made):
    """Issue #48: one generator a row (2.7 KB each) made a million one-token responses hold 2.7 GB."""
    seeds = [7, 0, 2**62 + 5, 7]
    expected = draw_uniforms([torch.Generator().manual_seed(seed) for seed in seeds], 5)
    generators_made.clear()  # the expected streams' own
    found = seeded_uniforms(seeds, 5)
    assert len(generators_made) == 1
    torch.testing.assert_close(found, expected, rtol=0, atol=0)
    fresh = seeded_uniforms([None, None], 3)
    assert fresh.shape == (2, 3) and not torch.equal(fresh[0], fresh[1])
