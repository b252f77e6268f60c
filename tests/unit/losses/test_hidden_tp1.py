"""The hidden-signal loss at TP=1: every divergence against the dense float64 reference (fused and
unfused, chunked and not, padded and unequal tables), the top-k path at k = V, and that the teacher's
hidden states reach the student's gradient."""

import pytest
import torch

from megatron_gkd.losses.hidden import hidden_distill_loss
from megatron_gkd.testing import hidden_losses as cases


def test_every_divergence_matches_the_dense_float64_reference_and_the_topk_path_at_k_equal_v():
    results = cases.check_everything()
    assert len(results["cases"]) == len(cases.make_cases(1)) * len(cases.LOSS_CONFIGS) * 4
    assert len(results["topk"]) >= 3 * len(cases.LOSS_CONFIGS)
    assert len(results["token_logprobs"]) == len(cases.make_cases(1)) * len(cases.TOKEN_LOGPROB_TOLERANCES)
    assert cases.failures(results) == []


def _problem(seed=0, num_tokens=9, vocab=20, h_s=6, h_t=10):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, h_s, generator=generator, dtype=torch.float64),
            torch.randn(vocab, h_s, generator=generator, dtype=torch.float64),
            torch.randn(num_tokens, h_t, generator=generator, dtype=torch.float64),
            torch.randn(vocab, h_t, generator=generator, dtype=torch.float64),
            torch.rand(num_tokens, generator=generator, dtype=torch.float64) + 0.1)


def _student_grad(hidden, table, teacher_hidden, teacher_table, weights, loss_type):
    hidden = hidden.clone().requires_grad_(True)
    total, _, _ = hidden_distill_loss(hidden, teacher_hidden, teacher_table, weights, student_weight=table,
                                      loss_type=loss_type, tp_group=None, chunk_size=4)
    total.backward()
    return total.detach(), hidden.grad


@pytest.mark.parametrize("loss_type", ["forward_kl", "reverse_kl", "jsd", "kl_rkl"])
def test_the_teachers_hidden_states_reach_the_students_gradient(loss_type):
    hidden, table, teacher_hidden, teacher_table, weights = _problem()
    _, grad = _student_grad(hidden, table, teacher_hidden, teacher_table, weights, loss_type)
    perturbed = teacher_hidden.clone()
    perturbed[3] += 0.5
    _, grad_perturbed = _student_grad(hidden, table, perturbed, teacher_table, weights, loss_type)
    changed = (grad - grad_perturbed).abs().amax(dim=1) > 1e-8
    assert changed.tolist() == [row == 3 for row in range(len(changed))]


@pytest.mark.parametrize("loss_type", ["forward_kl", "reverse_kl", "jsd", "kl_rkl", "tcad"])
def test_a_teacher_equal_to_the_student_gives_zero_loss_and_zero_gradient(loss_type):
    hidden, table, _, _, weights = _problem()
    table = table.clone().requires_grad_(True)
    student = hidden.clone().requires_grad_(True)
    total, per_token, metrics = hidden_distill_loss(student, hidden, table.detach(), weights, student_weight=table,
                                                    loss_type=loss_type, tp_group=None)
    total.backward()
    assert abs(float(total.detach())) < 1e-12 and per_token.abs().max() < 1e-12
    assert student.grad.abs().max() < 1e-12 and table.grad.abs().max() < 1e-12
    assert metrics["top1_agreement"].tolist() == [1.0] * len(weights)
    assert torch.allclose(metrics["teacher_entropy"], metrics["student_entropy"])


def test_without_autograd_the_loss_is_the_same_and_no_gradient_is_computed():
    hidden, table, teacher_hidden, teacher_table, weights = _problem()
    total, _ = _student_grad(hidden, table, teacher_hidden, teacher_table, weights, "jsd")
    with torch.no_grad():
        evaluated, _, _ = hidden_distill_loss(hidden.requires_grad_(True), teacher_hidden, teacher_table, weights,
                                              student_weight=table, loss_type="jsd", tp_group=None)
    assert float(evaluated) == pytest.approx(float(total), rel=1e-12)
    assert evaluated.grad_fn is None


def test_bad_inputs_name_what_is_wrong():
    hidden, table, teacher_hidden, teacher_table, weights = _problem()
    with pytest.raises(ValueError, match="teacher_weight"):
        hidden_distill_loss(hidden, teacher_hidden, teacher_table[:, :3], weights, student_weight=table,
                            loss_type="forward_kl", tp_group=None)
    with pytest.raises(ValueError, match="real_vocab_size"):
        hidden_distill_loss(hidden, teacher_hidden, teacher_table, weights, student_weight=table,
                            loss_type="forward_kl", tp_group=None, real_vocab_size=21)
    with pytest.raises(ValueError, match="no option 'betta'"):
        hidden_distill_loss(hidden, teacher_hidden, teacher_table, weights, student_weight=table,
                            loss_type="jsd", tp_group=None, betta=0.2)
