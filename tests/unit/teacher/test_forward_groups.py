"""How a batch is cut into forward passes (the ``hf`` backend's and the Megatron scorer's)."""

from megatron_gkd.teacher.backends.forward_groups import forward_groups, padded_length


def test_consecutive_rows_fill_the_budget_and_a_long_row_goes_alone():
    lengths = [3, 5, 4, 20, 2, 2, 9]
    groups = list(forward_groups(lengths, max_tokens=16))
    assert groups == [[0, 1, 2], [3], [4, 5], [6]]  # 5x3, 20 alone (over the budget), 2x2 (+9 would be 27)
    assert [i for group in groups for i in group] == list(range(len(lengths)))
    for group in groups:
        if len(group) > 1:
            assert max(lengths[i] for i in group) * len(group) <= 16


def test_lengths_round_up_to_the_sequence_parallel_multiple():
    assert [padded_length(n, 4) for n in (1, 4, 5)] == [4, 4, 8]
    assert list(forward_groups([5, 5], max_tokens=16, multiple=4)) == [[0, 1]]  # 8 x 2 = 16 fits
    assert list(forward_groups([5, 5], max_tokens=15, multiple=4)) == [[0], [1]]  # 8 x 2 does not (5 x 2 would)
    assert list(forward_groups([5, 5], max_tokens=15)) == [[0, 1]]
