"""PromptSampler (seeded epochs, resumable position)."""

import json

import pytest

from megatron_gkd.data import PromptSampler


def _batches(sampler, num):
    return [sampler.next_batch() for _ in range(num)]


def test_same_seed_same_batches_other_seed_other_order():
    first = _batches(PromptSampler(10, 3, shuffle=True, seed=5), 9)
    assert first == _batches(PromptSampler(10, 3, shuffle=True, seed=5), 9)
    assert first != _batches(PromptSampler(10, 3, shuffle=True, seed=6), 9)


def test_epochs_are_fresh_permutations_and_drop_the_incomplete_batch():
    sampler = PromptSampler(10, 3, shuffle=True, seed=0)
    epochs = []
    for _ in range(4):
        batches = _batches(sampler, 3)  # 9 of 10 positions; the 10th is left out of this epoch
        epochs.append((sampler.epoch, sum(batches, [])))
    assert [epoch for epoch, _ in epochs] == [0, 1, 2, 3]
    for _, positions in epochs:
        assert len(set(positions)) == 9 and set(positions) <= set(range(10))
    assert len({tuple(positions) for _, positions in epochs}) == 4
    assert set().union(*(set(positions) for _, positions in epochs)) == set(range(10))


def test_without_shuffle_positions_come_in_order():
    sampler = PromptSampler(5, 2, shuffle=False, seed=0)
    assert _batches(sampler, 4) == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert sampler.epoch == 1


def test_epoch_is_that_of_the_last_batch():
    sampler = PromptSampler(4, 2, shuffle=True, seed=0)
    assert sampler.epoch == 0
    _batches(sampler, 2)
    assert sampler.epoch == 0  # the epoch is used up, but the next one starts only with the next batch
    sampler.next_batch()
    assert sampler.epoch == 1


@pytest.mark.parametrize("num_before", [0, 1, 3, 4, 5, 9])  # fresh, mid-epoch, epoch boundaries, later epochs
def test_restored_state_continues_exactly(num_before):
    reference = PromptSampler(13, 4, shuffle=True, seed=3)
    expected = _batches(reference, num_before + 7)
    interrupted = PromptSampler(13, 4, shuffle=True, seed=3)
    _batches(interrupted, num_before)
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = PromptSampler(13, 4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert resumed.epoch == interrupted.epoch
    assert _batches(resumed, 7) == expected[num_before:]
    assert resumed.state_dict() == reference.state_dict()


def test_state_dict_holds_the_documented_keys():
    sampler = PromptSampler(13, 4, shuffle=True, seed=3)
    sampler.next_batch()
    assert sampler.state_dict() == {"epoch": 0, "position": 4, "seed": 3, "shuffle": True, "num_items": 13,
                                    "batch_size": 4}


@pytest.mark.parametrize("changed, match", [
    ({"num_items": 12}, "num_items 12 -> 13"),
    ({"batch_size": 2}, "batch_size 2 -> 4"),
    ({"seed": 4}, "seed 4 -> 3"),
    ({"shuffle": False}, "shuffle False -> True"),
])
def test_state_from_another_setup_is_refused(changed, match):
    state = PromptSampler(13, 4, shuffle=True, seed=3).state_dict() | changed
    with pytest.raises(ValueError, match=match + ".*same prompt file"):
        PromptSampler(13, 4, shuffle=True, seed=3).load_state_dict(state)


def test_corrupt_state_is_refused():
    state = PromptSampler(13, 4, shuffle=True, seed=3).state_dict() | {"position": 14}
    with pytest.raises(ValueError, match="corrupt"):
        PromptSampler(13, 4, shuffle=True, seed=3).load_state_dict(state)


def test_bad_sizes():
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptSampler(3, 4, shuffle=True, seed=0)
    with pytest.raises(ValueError, match=">= 1"):
        PromptSampler(3, 0, shuffle=True, seed=0)

