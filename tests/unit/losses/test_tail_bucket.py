"""The tail bucket (``tail_bucket=True``) at TP=1: every divergence over the teacher's k ids and the mass outside them,
unfused and fused, against the dense float64 reference; what tells it from the renormalised top-k; the edges (a
teacher tail that rounds to 0 or below, a student tail of 1e-11 in float32, ids covering the whole vocabulary, a
sampled token riding along); TCAD refused. TP=2: tests/distributed/losses/test_tail_bucket_tp.py."""

import math

import pytest
import torch

from megatron_gkd.losses import fused_vocab_parallel_distill_loss, vocab_parallel_distill_loss
from megatron_gkd.losses.reference import reference_distill_loss, reference_tail_distill_loss
from megatron_gkd.losses.tail import TAIL_MASS_FLOOR, teacher_tail_logprob
from megatron_gkd.testing import tail_bucket as cases


def test_every_divergence_matches_the_float64_reference_unfused_and_fused():
    errors = cases.tail_errors()
    assert len(errors) == len(cases.real_vocab_sizes(1)) * len(cases.TAIL_LOSSES) * 2 * 2
    assert cases.failures(errors) == []


def _one_row(student_probs, teacher_probs, ids=(0, 1)):
    logits = torch.tensor([student_probs], dtype=torch.float64).log()
    return logits, torch.tensor([list(ids)]), torch.tensor([teacher_probs], dtype=torch.float64).log()


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def test_reverse_kl_with_the_tail_is_the_kl_over_k_plus_1_outcomes_not_the_renormalised_one():
    # Teacher: 0.5, 0.3 on its top-2 and 0.2 elsewhere; student: 0.6, 0.3 and 0.1 on ids 2 and 3.
    logits, ids, logprobs = _one_row([0.6, 0.3, 0.05, 0.05], [0.5, 0.3])
    with_tail, _ = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="reverse_kl", tp_group=None,
                                               tail_bucket=True)
    without, _ = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="reverse_kl", tp_group=None)
    assert with_tail.item() == pytest.approx(_kl([0.6, 0.3, 0.1], [0.5, 0.3, 0.2]), rel=1e-12)
    assert without.item() == pytest.approx(_kl([2 / 3, 1 / 3], [5 / 8, 3 / 8]), rel=1e-12)
    assert with_tail.item() > 10 * without.item()
    # The renormalised loss cannot see mass moved outside the top-k at the same ratio on it; the tail bucket can.
    leaky, ids, logprobs = _one_row([0.2, 0.1, 0.35, 0.35], [0.5, 0.3])
    leaky_tail, _ = vocab_parallel_distill_loss(leaky, ids, logprobs, loss_type="reverse_kl", tp_group=None,
                                                tail_bucket=True)
    leaky_without, _ = vocab_parallel_distill_loss(leaky, ids, logprobs, loss_type="reverse_kl", tp_group=None)
    assert leaky_without.item() == pytest.approx(without.item(), rel=1e-12)
    assert leaky_tail.item() == pytest.approx(_kl([0.2, 0.1, 0.7], [0.5, 0.3, 0.2]), rel=1e-12)
    assert leaky_tail.item() > with_tail.item() + 0.3


def test_forward_kl_with_the_tail_adds_the_tail_term_and_its_gradient():
    logits, ids, logprobs = _one_row([0.6, 0.3, 0.05, 0.05], [0.5, 0.3])
    logits.requires_grad_()
    loss, _ = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="forward_kl", tp_group=None,
                                          tail_bucket=True)
    loss.sum().backward()
    assert loss.item() == pytest.approx(_kl([0.5, 0.3, 0.2], [0.6, 0.3, 0.1]), rel=1e-12)
    # d/dz_i = q_i - p_i on the ids; outside, the tail's mass splits by the student's odds: q_i - p_tail q_i / q_tail
    expected = torch.tensor([[0.6 - 0.5, 0.3 - 0.3, 0.05 - 0.2 * 0.5, 0.05 - 0.2 * 0.5]], dtype=torch.float64)
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-12)


def test_a_teacher_tail_at_or_below_zero_from_rounding_is_the_floor():
    logprobs = torch.log_softmax(torch.tensor([[2.0, 1.0, -40.0, -40.0]], dtype=torch.float64), -1)[:, :2]
    rounded_up = logprobs + 1e-7  # sums a little past 1
    valid = torch.ones_like(logprobs, dtype=torch.bool)
    assert teacher_tail_logprob(logprobs, valid).item() == pytest.approx(math.log(TAIL_MASS_FLOOR))
    assert teacher_tail_logprob(rounded_up, valid).item() == pytest.approx(math.log(TAIL_MASS_FLOOR))
    assert teacher_tail_logprob(logprobs - 0.1, valid).item() == pytest.approx(math.log(1 - math.exp(-0.1)))
    logits = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    for loss_type in ("forward_kl", "reverse_kl", "jsd"):
        loss, _ = vocab_parallel_distill_loss(logits, torch.tensor([[0, 1]]), rounded_up, loss_type=loss_type,
                                              tp_group=None, tail_bucket=True)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(logits.grad).all()


def test_a_tiny_student_tail_is_exact_in_float32():
    # The top-k holds all but ~1e-11 of the student's mass: 1 - sum(q) in float32 is 0 or rounding noise, the
    # log-sum-exp of the logits outside the ids is not.
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=generator, dtype=torch.float64)
    logits[:, :3] += 30.0
    ids = torch.arange(3).expand(4, 3)
    logprobs = torch.log(torch.tensor([[0.4, 0.3, 0.2]] * 4, dtype=torch.float64)).float()
    narrow = logits.float().requires_grad_()
    loss, _ = vocab_parallel_distill_loss(narrow, ids, logprobs, loss_type="forward_kl", tp_group=None,
                                          tail_bucket=True)
    loss.sum().backward()
    full = narrow.detach().double().requires_grad_()
    expected = reference_tail_distill_loss(full, ids, logprobs, "forward_kl")
    expected.sum().backward()
    assert 1 - torch.softmax(narrow.detach(), -1)[:, :3].sum(-1).max().item() < 1e-6  # float32 cannot tell the tail
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(narrow.grad.double(), full.grad, rtol=0, atol=1e-5 * full.grad.abs().max().item())


def test_ids_covering_the_whole_vocabulary_leave_no_tail_outcome():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 8, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(3, 8, generator=generator, dtype=torch.float64), -1)
    logprobs, ids = teacher.topk(8, -1)
    for loss_type in ("forward_kl", "reverse_kl", "jsd"):
        with_tail, _ = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type=loss_type, tp_group=None,
                                                   tail_bucket=True)
        without, _ = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type=loss_type, tp_group=None)
        torch.testing.assert_close(with_tail, without, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(with_tail, reference_tail_distill_loss(logits, ids, logprobs, loss_type),
                                   rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_sampled_token_riding_along_gets_the_same_gradient(fused):
    """``token_ids`` (the policy-gradient term's sampled tokens) ride in the same pass; with the tail bucket the
    teacher's ids are written, not added, so a token among them must still add its own part."""
    generator = torch.Generator().manual_seed(7)
    n, vocab, real, hidden_size = 10, 32, 29, 6
    hidden = torch.randn(n, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(n, real, generator=generator, dtype=torch.float64), -1)
    logprobs, ids = teacher.topk(5, -1)
    tokens = torch.randint(0, real, (n,), generator=generator)
    tokens[:4] = ids[:4, 2]  # sampled tokens that are also teacher ids
    weights = torch.randn(n, generator=generator, dtype=torch.float64)
    token_weights = torch.randn(n, generator=generator, dtype=torch.float64)
    common = dict(loss_type="jsd", tp_group=None, temperature=1.2, real_vocab_size=real, tail_bucket=True)

    def run(together: bool):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        if fused:
            loss, metrics = fused_vocab_parallel_distill_loss(*leaves, ids, logprobs, chunk_size=3,
                                                              **({"token_ids": tokens} if together else {}), **common)
        else:
            loss, metrics = vocab_parallel_distill_loss(leaves[0] @ leaves[1].t(), ids, logprobs,
                                                        **({"token_ids": tokens} if together else {}), **common)
        if together:
            token = metrics["token_logprobs"]
        else:
            token = torch.log_softmax((leaves[0] @ leaves[1].t())[:, :real] / 1.2, -1).gather(1, tokens[:, None])[:, 0]
        (loss @ weights + token @ token_weights).backward()
        return loss, token, leaves[0].grad, leaves[1].grad

    for got, expected in zip(run(True), run(False)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_the_tail_is_refused_with_tcad():
    logits, ids, logprobs = _one_row([0.6, 0.3, 0.05, 0.05], [0.5, 0.3])
    with pytest.raises(ValueError, match="tail_bucket=True does not apply to loss_type='tcad'"):
        vocab_parallel_distill_loss(logits, ids, logprobs, loss_type="tcad", tp_group=None, tail_bucket=True)
    with pytest.raises(ValueError, match="coverage_coef"):
        fused_vocab_parallel_distill_loss(torch.randn(1, 3), torch.randn(4, 3), ids, logprobs.float(),
                                          loss_type="tcad", tp_group=None, tail_bucket=True)


def test_off_the_loss_is_the_renormalised_one_as_before():
    logits, ids, logprobs = _one_row([0.6, 0.3, 0.05, 0.05], [0.5, 0.3])
    for loss_type in ("forward_kl", "reverse_kl", "jsd", "kl_rkl"):
        off, _ = vocab_parallel_distill_loss(logits, ids, logprobs, loss_type=loss_type, tp_group=None,
                                             tail_bucket=False)
        torch.testing.assert_close(off, reference_distill_loss(logits, ids, logprobs, loss_type), rtol=1e-12, atol=0)
