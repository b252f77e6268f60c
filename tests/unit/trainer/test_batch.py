"""Batch plumbing: teacher rows land on the positions that predict each response token, coefficients
make a step's loss independent of how it is cut, micro-batches respect their budget, TCAD's support
takes its log-probs from the teacher's top-k or from the requested student ids."""

import numpy as np
import pytest
import torch

from megatron_gkd.losses import tcad_sequence_weights, tcad_support
from megatron_gkd.teacher import TeacherOutput
from megatron_gkd.trainer.batch import (
    Sample,
    TCADSpec,
    build_microbatch,
    plan_microbatches,
    score_batch,
    split_to_count,
    teacher_rows,
    token_coefficients,
)


def _sample(prompt, response, group=0, topk=None):
    return Sample(tokens=torch.tensor(prompt + response), prompt_len=len(prompt), group=group, prompt_index=group,
                  student_topk=topk)


def _output(num_rows, k, seed, requested=None):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_rows, 50))
    logprobs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    order = np.argsort(-logprobs, axis=1)[:, :k]
    out = TeacherOutput(topk_ids=order.astype(np.int64),
                        topk_logprobs=np.take_along_axis(logprobs, order, 1).astype(np.float32),
                        token_logprobs=logprobs[:, 0].astype(np.float32),
                        requested_logprobs=None if requested is None else
                        np.take_along_axis(logprobs, requested, 1).astype(np.float32))
    return out, logprobs


def test_rows_sit_at_the_positions_that_predict_each_response_token():
    samples = [_sample([5, 6, 7], [8, 9]), _sample([3], [4, 10, 11, 12])]
    outputs = [_output(2, 3, 0)[0], _output(4, 3, 1)[0]]
    rows = teacher_rows(outputs, samples)
    coefficients = token_coefficients(samples, total_tokens=6, num_groups=2)
    mb = build_microbatch(samples, coefficients, rows=rows.split([2, 4]), labels=True)
    # Sample 0 reads [5, 6, 7, 8]; position 2 (token 7) predicts response token 0 (8).
    assert mb.tokens.tolist() == [[5, 6, 7, 8], [3, 4, 10, 11]]
    assert mb.loss_mask.tolist() == [[False, False, True, True], [True, True, True, True]]
    assert mb.labels[0, 2] == 8 and mb.labels[0, 3] == 9 and mb.labels[1, 0] == 4
    np.testing.assert_array_equal(mb.teachers[0].ids[0, 2].numpy(), outputs[0].topk_ids[0])
    np.testing.assert_array_equal(mb.teachers[0].ids[0, 3].numpy(), outputs[0].topk_ids[1])
    np.testing.assert_array_equal(mb.teachers[0].ids[1, 0].numpy(), outputs[1].topk_ids[0])
    assert torch.isneginf(mb.teachers[0].logprobs[0, :2]).all()  # no teacher row: padding, no loss
    assert mb.coefficients.sum().item() == pytest.approx(1.0)
    assert mb.position_ids[1].tolist() == [0, 1, 2, 3]


def test_padding_to_a_multiple_for_sequence_parallelism():
    mb = build_microbatch([_sample([1, 2], [3])], [torch.ones(1)], pad_multiple=4)
    assert mb.shape == (1, 4) and mb.loss_mask.tolist() == [[False, True, False, False]]


def test_padding_mask_marks_every_position_past_a_samples_input():
    # The MoE router leaves these out of its load-balancing loss and the expert-load metrics.
    mb = build_microbatch([_sample([1, 2], [3]), _sample([4], [5, 6, 7])], [torch.ones(1), torch.ones(3)], pad_multiple=2,
                          shape=(3, 6))
    assert mb.padding_mask.tolist() == [[False, False, True, True, True, True], [False, False, False, True, True, True],
                                        [True] * 6]


def test_split_to_count_halves_the_largest_micro_batches_in_order():
    # Expert-parallel ranks must run as many micro-batches as each other; the cuts keep order and budget.
    assert split_to_count([[0, 1, 2, 3], [4]], 4) == [[0], [1], [2, 3], [4]]
    assert split_to_count([[0, 1]], 1) == [[0, 1]]
    with pytest.raises(AssertionError):
        split_to_count([[0, 1]], 3)


def test_confidence_coefficients_weight_each_group_to_one_over_groups():
    samples = [_sample([1], [2, 3], group=0), _sample([1], [4], group=0), _sample([7], [8, 9, 10], group=1)]
    token_lp = [torch.tensor([-0.1, -0.2]), torch.tensor([-3.0]), torch.tensor([-1.0, -1.0, -1.0])]
    coefficients = token_coefficients(samples, total_tokens=6, num_groups=2, teacher_token_logprobs=token_lp,
                                      confidence_alpha=1.0)
    per_sample = [c.sum().item() for c in coefficients]
    assert per_sample[0] + per_sample[1] == pytest.approx(0.5) and per_sample[2] == pytest.approx(0.5)
    assert per_sample[0] > per_sample[1]  # the teacher is more confident in response 0
    weights = tcad_sequence_weights(torch.tensor([[-0.1, -0.2], [-3.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]).bool(),
                                    torch.tensor([0, 0]), 1.0)
    assert per_sample[0] == pytest.approx(float(weights[0]) / 2)
    # Within a sample every token carries the same share.
    assert torch.allclose(coefficients[0], coefficients[0][:1].expand(2))


def test_plan_keeps_every_sample_once_and_under_the_budget():
    lengths = [5, 17, 3, 9, 9, 30, 1]
    plan = plan_microbatches(lengths, max_tokens=34)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        assert len(mb) * max(lengths[i] for i in mb) <= 34
    assert plan_microbatches(lengths, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_microbatches([40], max_tokens=34)


def test_tcad_rows_take_log_probs_from_teacher_topk_or_requested_ids():
    student_topk = torch.tensor([[7, 3, 49], [2, 60, -1]])  # 60: past the vocabulary (50); -1: padding
    sample = _sample([1, 2], [5, 6], topk=student_topk)
    request = score_batch([sample], top_k=4, temperature=1.0, vocab_size=50, request_student_topk=True)
    requested = request.sequences[0].requested_ids
    assert requested.tolist() == [[7, 3, 49], [2, 0, 0]]
    output, logprobs = _output(2, 4, 2, requested=requested)
    rows = teacher_rows([output], [sample], tcad=TCADSpec(support_k=6), vocab_size=50)
    teacher_ids = torch.from_numpy(output.topk_ids)
    expected = tcad_support(teacher_ids, torch.tensor([[7, 3, 49], [2, -1, -1]]), 6)
    for row in range(2):
        for column, token in enumerate(expected[row].tolist()):
            if token < 0:
                assert torch.isneginf(rows.logprobs[row, column]) and rows.ids[row, column] == 0
            else:
                assert rows.ids[row, column] == token
                assert rows.logprobs[row, column].item() == pytest.approx(logprobs[row, token], abs=1e-6)
