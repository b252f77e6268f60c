"""One source of the student's logits for every term: the logit shard ``[s, b, V]`` and the fused hidden states
``[b, s, h]`` + output weight answer the same questions in the batch's ``[b, s]`` layout, each equal to the dense
float64 reference (the sampled tokens' log-probs, a top-k divergence with the tokens riding along, a divergence
against the teacher's hidden states), values and gradients."""

import pytest
import torch

from megatron_gkd.losses.reference import reference_distill_loss, reference_full_vocab_loss, reference_token_logprobs
from megatron_gkd.losses.student_logits import FusedLogits, LogitShard

BATCH, SEQ, HIDDEN, VOCAB, REAL, K = 2, 3, 5, 12, 10, 4


def _inputs():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    teacher_logprobs, teacher_ids = torch.log_softmax(
        torch.randn(BATCH, SEQ, REAL, generator=generator, dtype=torch.float64), -1).topk(K, -1)
    token_ids = torch.randint(0, REAL, (BATCH, SEQ), generator=generator)
    return hidden, weight, teacher_ids, teacher_logprobs, token_ids


def _source(fused: bool, hidden: torch.Tensor, weight: torch.Tensor):
    if fused:
        return FusedLogits(hidden, weight, None, chunk_size=2)
    return LogitShard((hidden @ weight.t()).transpose(0, 1), None, chunk_size=2)  # [s, b, V], as the layer makes it


@pytest.mark.parametrize("fused", [False, True], ids=["shard", "fused"])
def test_every_answer_of_either_source_is_the_dense_reference_in_the_batch_layout(fused):
    hidden, weight, teacher_ids, teacher_logprobs, token_ids = _inputs()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    source = _source(fused, hidden, weight)
    dense = (hidden @ weight.t()).reshape(-1, VOCAB)

    logprobs = source.token_logprobs(token_ids, temperature=0.7, real_vocab_size=REAL)
    expected = reference_token_logprobs(dense, token_ids.reshape(-1), temperature=0.7, real_vocab_size=REAL)
    assert logprobs.shape == (BATCH, SEQ)
    torch.testing.assert_close(logprobs.reshape(-1), expected, rtol=1e-12, atol=1e-12)

    per_token, metrics = source.distill(teacher_ids, teacher_logprobs, loss_type="jsd", token_ids=token_ids,
                                        real_vocab_size=REAL, beta=0.3)
    expected_loss = reference_distill_loss(dense, teacher_ids.reshape(-1, K), teacher_logprobs.reshape(-1, K), "jsd",
                                           real_vocab_size=REAL, beta=0.3)
    assert per_token.shape == metrics["token_logprobs"].shape == (BATCH, SEQ)
    torch.testing.assert_close(per_token.reshape(-1), expected_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["token_logprobs"].reshape(-1),
                               reference_token_logprobs(dense, token_ids.reshape(-1), real_vocab_size=REAL))

    (per_token.sum() + logprobs.sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    dense = (hidden @ weight.t()).reshape(-1, VOCAB)
    (reference_distill_loss(dense, teacher_ids.reshape(-1, K), teacher_logprobs.reshape(-1, K), "jsd",
                            real_vocab_size=REAL, beta=0.3).sum()
     + reference_token_logprobs(dense, token_ids.reshape(-1), temperature=0.7, real_vocab_size=REAL).sum()).backward()
    torch.testing.assert_close(grads, (hidden.grad, weight.grad), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True], ids=["shard", "fused"])
def test_a_hidden_state_teacher_s_divergence_from_either_source_is_the_dense_reference(fused):
    hidden, weight, *_ = _inputs()
    generator = torch.Generator().manual_seed(1)
    teacher_hidden = torch.randn(BATCH, SEQ, 7, generator=generator, dtype=torch.float64)
    head = torch.randn(VOCAB, 7, generator=generator, dtype=torch.float64)
    weights = torch.rand(BATCH, SEQ, generator=generator, dtype=torch.float64)
    weights[1, 2] = 0.0  # never read
    total, per_token, _ = _source(fused, hidden, weight).hidden(teacher_hidden, head, weights, loss_type="reverse_kl",
                                                                real_vocab_size=REAL)
    expected = reference_full_vocab_loss((hidden @ weight.t()).reshape(-1, VOCAB),
                                         (teacher_hidden @ head.t()).reshape(-1, VOCAB), "reverse_kl",
                                         real_vocab_size=REAL).reshape(BATCH, SEQ)
    assert per_token.shape == (BATCH, SEQ)
    torch.testing.assert_close(per_token * (weights != 0), expected * (weights != 0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, (expected * weights).sum(), rtol=1e-12, atol=1e-12)
