"""TCAD helpers against straightforward Python loop references; aggregation over micro-batches."""

import math
import random

import pytest
import torch

from megatron_gkd.losses import tcad_sequence_weights, tcad_support


def _support_loop(teacher, student, k, mode):
    """The definition, one token at a time."""
    order = []
    for i in range(max(len(teacher), len(student))):
        if i < len(teacher):
            order.append(teacher[i])
        if i < len(student):
            order.append(student[i])
    seen = []
    for token in order:
        if token >= 0 and token not in seen:
            seen.append(token)
    width = len(teacher) + len(student) if mode == "union" else k
    seen = seen[:width]
    return seen + [-1] * (width - len(seen))


@pytest.mark.parametrize("mode, k_teacher, k_student, k", [
    ("interleave", 8, 8, 8), ("interleave", 8, 4, 6), ("interleave", 3, 6, 9), ("union", 8, 8, None),
    ("interleave", 256, 256, 256),
])
def test_tcad_support_matches_loop(mode, k_teacher, k_student, k):
    generator = torch.Generator().manual_seed(k_teacher + k_student)
    vocab = 12 if k_teacher < 100 else 600  # small vocabulary: many shared ids
    teacher = torch.stack([torch.randperm(vocab, generator=generator)[:k_teacher] for _ in range(40)])
    student = torch.stack([torch.randperm(vocab, generator=generator)[:k_student] for _ in range(40)])
    student[0] = teacher[0, :k_student] if k_student <= k_teacher else student[0]  # identical lists
    teacher[1, -2:] = -1  # padded teacher entries are skipped
    result = tcad_support(teacher.reshape(4, 10, -1), student.reshape(4, 10, -1), k, mode=mode)
    result = result.reshape(40, -1)
    for row in range(40):
        assert result[row].tolist() == _support_loop(teacher[row].tolist(), student[row].tolist(), k, mode)


def test_tcad_support_interleave_example():
    teacher = torch.tensor([[5, 7, 9, 11]])
    student = torch.tensor([[7, 3, 5, 2]])
    assert tcad_support(teacher, student, 4).tolist() == [[5, 7, 3, 9]]


def test_tcad_support_rejects_bad_arguments():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="mode"):
        tcad_support(ids, ids, 3, mode="both")
    with pytest.raises(ValueError, match="k=7"):
        tcad_support(ids, ids, 7)


def _weights_loop(logprobs, masks, groups, alpha):
    confidence = {}
    for index, (lp, mask) in enumerate(zip(logprobs, masks)):
        tokens = [v for v, m in zip(lp, mask) if m]
        confidence[index] = sum(tokens) / len(tokens) if tokens else None
    weights = [0.0] * len(logprobs)
    for group in set(groups):
        members = [i for i, g in enumerate(groups) if g == group and confidence[i] is not None]
        if not members:
            continue
        mean = sum(confidence[i] for i in members) / len(members)
        exps = {i: math.exp(alpha * (confidence[i] - mean)) for i in members}
        total = sum(exps.values())
        for i in members:
            weights[i] = exps[i] / total
    return weights


def _batch(seed, num_sequences=13, length=9):
    rng = random.Random(seed)
    logprobs = [[-rng.uniform(0, 4) for _ in range(length)] for _ in range(num_sequences)]
    masks = [[1 if t < rng.randint(1, length) else 0 for t in range(length)] for _ in range(num_sequences)]
    masks[5] = [0] * length  # an empty response
    groups = [rng.choice([3, 8, 1, 42]) for _ in range(num_sequences)]  # any order, any ids
    return logprobs, masks, groups


@pytest.mark.parametrize("alpha", [0.0, 1.0, 5.0])
def test_tcad_sequence_weights_match_loop_with_groups_spanning_micro_batches(alpha):
    logprobs, masks, groups = _batch(int(alpha))
    expected = _weights_loop(logprobs, masks, groups, alpha)
    whole = tcad_sequence_weights(torch.tensor(logprobs), torch.tensor(masks), torch.tensor(groups), alpha)
    assert whole.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # Uneven micro-batches with different padded lengths; every group spans several of them.
    bounds = [(0, 4), (4, 5), (5, 13)]
    pad = [2, 0, 5]
    micro = [
        (torch.nn.functional.pad(torch.tensor(logprobs[a:b]), (0, p), value=-100.0),
         torch.nn.functional.pad(torch.tensor(masks[a:b]), (0, p), value=0),
         torch.tensor(groups[a:b]))
        for (a, b), p in zip(bounds, pad)
    ]
    split = tcad_sequence_weights(*[list(parts) for parts in zip(*micro)], alpha)
    assert isinstance(split, list) and [w.shape[0] for w in split] == [4, 1, 8]
    assert torch.cat(split).tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert whole[5] == 0.0 and not whole.requires_grad
