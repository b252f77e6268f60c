"""The sampling policy of the engines that pick tokens themselves (:mod:`megatron_gkd.rollout.sampling`)."""

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.rollout.sampling import sample_generators, sample_next


def _multinomial_reference(scores, generators, temperature, top_k, top_p):
    """The policy written with one ``torch.multinomial`` a row (what the teacher backends drew before)."""
    ordered, order = torch.sort(scores.float() / temperature, dim=-1, descending=True, stable=True)
    if 0 < top_k < ordered.shape[-1]:
        ordered[:, top_k:] = -torch.inf
    probs = torch.softmax(ordered, dim=-1)
    if top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    picks = torch.stack([torch.multinomial(row, 1, generator=g)[0] for row, g in zip(probs, generators)])
    return order.gather(1, picks[:, None])[:, 0]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.5)])
def test_the_draw_is_torchs_multinomial_for_the_same_generators(temperature, top_k, top_p):
    scores = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    scores[:8, 100:] = -torch.inf  # rows with columns that cannot be picked
    seeds = range(64)
    got = sample_next(scores, [torch.Generator().manual_seed(s) for s in seeds], temperature=temperature, top_k=top_k,
                      top_p=top_p)
    expected = _multinomial_reference(scores, [torch.Generator().manual_seed(s) for s in seeds], temperature, top_k, top_p)
    assert got.equal(expected)
    assert (got[:8] < 100).all()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 1.0), (0, 0.8)])
def test_the_draw_does_not_depend_on_the_order_of_the_columns(top_k, top_p):
    # The megatron teacher backend samples from its top-k rows (in order of probability), the hf backend from the
    # logits in id order: one seed must pick the same id from both.
    scores = torch.randn(32, 300, generator=torch.Generator().manual_seed(2)) * 3
    order = torch.stack([torch.randperm(300, generator=torch.Generator().manual_seed(row)) for row in range(32)])
    by_id = sample_next(scores, [torch.Generator().manual_seed(s) for s in range(32)], temperature=1.0, top_k=top_k,
                        top_p=top_p)
    permuted = sample_next(scores.gather(1, order), [torch.Generator().manual_seed(s) for s in range(32)],
                           temperature=1.0, top_k=top_k, top_p=top_p)
    assert order.gather(1, permuted[:, None])[:, 0].equal(by_id)


def test_greedy_takes_the_lowest_of_tied_columns():
    scores = torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 3.0]])
    assert sample_next(scores, [torch.Generator()] * 2, temperature=0.0, top_k=0, top_p=1.0).tolist() == [1, 0]


def test_generators_are_seeded_per_sample_as_sampling_config_says():
    sampling = SamplingConfig(n=3, seed=10)
    draws = [g.initial_seed() for g in sample_generators(sampling, 2)]
    assert draws == [10, 11, 12, 13, 14, 15]
    unseeded = sample_generators(SamplingConfig(n=2, seed=None), 1)
    assert unseeded[0].initial_seed() != unseeded[1].initial_seed()
