"""What the student keeps, from scores made by hand."""

import torch

from megatron_gkd.prune import Importance, KeptIndices, ModelSizes, PruneTargets, select_kept
from megatron_gkd.prune.selection import top

TEACHER = ModelSizes(num_layers=4, hidden_size=6, ffn_hidden_size=5, num_attention_heads=9, num_query_groups=3,
                     kv_channels=2)


def _importance(**scores) -> Importance:
    zeros = dict(layers=torch.zeros(4), heads=torch.zeros(4, 9), ffn=torch.zeros(4, 5), hidden=torch.zeros(4, 6),
                 final_hidden=torch.zeros(6))
    return Importance(**{**zeros, **scores}, loss=0.0, depth_metric="cosine")


def test_top_keeps_the_highest_in_the_teachers_order_and_breaks_ties_to_the_lower_index():
    assert top(torch.tensor([0.1, 0.9, 0.5, 0.9]), 2) == [1, 3]
    assert top(torch.tensor([1.0, 1.0, 1.0]), 2) == [0, 1]
    assert top(torch.tensor([3.0, 1.0, 2.0]), 3) == [0, 1, 2]


def test_layers_and_mlp_channels_are_the_most_important_of_each_layer():
    ffn = torch.tensor([[5, 4, 3, 2, 1], [1, 2, 3, 4, 5], [0, 9, 0, 9, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    importance = _importance(layers=torch.tensor([0.5, 0.1, 0.7, 0.2]), ffn=ffn)
    kept = select_kept(importance, TEACHER, PruneTargets(num_layers=2, ffn_hidden_size=2).resolve(TEACHER))
    assert kept.layers == [0, 2]
    assert kept.ffn == [[0, 1], [1, 3]]


def test_heads_are_kept_inside_each_group_and_groups_by_their_heads_sum():
    heads = torch.zeros(4, 9)
    heads[0] = torch.tensor([1.0, 5.0, 3.0, 9.0, 0.0, 0.1, 2.0, 2.0, 2.0])  # groups sum to 9, 9.1, 6
    kept = select_kept(_importance(heads=heads), TEACHER, PruneTargets(num_attention_heads=6).resolve(TEACHER))
    assert kept.query_groups[0] == [0, 1, 2]
    assert kept.heads[0] == [1, 2, 3, 5, 6, 7]  # two of each group: (5, 3), (9, 0.1), a tie (2, 2) to the lower
    kept = select_kept(_importance(heads=heads), TEACHER,
                       PruneTargets(num_query_groups=2, num_attention_heads=2).resolve(TEACHER))
    assert kept.query_groups[0] == [0, 1] and kept.heads[0] == [1, 3]


def test_hidden_channels_rank_over_the_kept_layers_norms_only():
    hidden = torch.zeros(4, 6)
    hidden[1, 5] = 100.0  # a dropped layer's norm reads channel 5 strongly
    hidden[0] = torch.tensor([1.0, 0.0, 0.0, 3.0, 0.0, 0.0])
    final = torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, 0.5])
    importance = _importance(layers=torch.tensor([1.0, 0.0, 1.0, 1.0]), hidden=hidden, final_hidden=final)
    kept = select_kept(importance, TEACHER, PruneTargets(num_layers=3, hidden_size=3).resolve(TEACHER))
    assert kept.layers == [0, 2, 3]
    assert kept.hidden == [0, 2, 3]


def test_kept_indices_travel_as_plain_data():
    kept = KeptIndices(layers=[0, 2], hidden=[1], query_groups=[[0], [1]], heads=[[0, 1], [3, 4]], ffn=[[0], [2]])
    assert KeptIndices.from_dict(kept.to_dict()) == kept
