"""The step trains the tail bucket when ``loss.tail_bucket`` asks: one teacher's contribution is
``sum(coefficient x loss)`` of the tail-bucket divergence (of the renormalised one without the flag), unfused (the
output layer's ``[s, b, V/tp]`` logits) and fused (its hidden states and weight)."""

import types

import pytest
import torch

from megatron_gkd.losses.reference import reference_distill_loss, reference_tail_distill_loss
from megatron_gkd.losses.terms import divergence_term
from megatron_gkd.trainer.logit_capture import student_logits
from megatron_gkd.trainer.specs import LossSpec


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("tail_bucket", [False, True], ids=["renormalised", "tail_bucket"])
def test_a_teacher_loss_is_the_divergence_the_spec_names(gloo_world, fused, tail_bucket):
    generator = torch.Generator().manual_seed(0)
    batch, seq, hidden_size, vocab, real, k = 2, 3, 6, 16, 14, 4
    hidden = torch.randn(batch, seq, hidden_size, generator=generator, dtype=torch.float64)  # [b, s, h]
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    logprobs, ids = torch.log_softmax(torch.randn(batch, seq, real, generator=generator, dtype=torch.float64),
                                      -1).topk(k, -1)
    coefficients = torch.rand(batch, seq, generator=generator, dtype=torch.float64)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[1, -1] = False
    share = types.SimpleNamespace(ids=ids, logprobs=logprobs, coefficients=coefficients, name="teacher")
    captured = types.SimpleNamespace(logits=(hidden @ weight.t()).transpose(0, 1).contiguous(), weight=weight,
                                     sequence_parallel=False)
    spec = LossSpec(loss_type="reverse_kl", fused=fused, chunk_size=2, real_vocab_size=real, tail_bucket=tail_bucket)
    contribution, _ = divergence_term(spec, student_logits(spec, captured, hidden, gloo_world), share, mask)
    reference = reference_tail_distill_loss if tail_bucket else reference_distill_loss
    per_token = reference(hidden.reshape(-1, hidden_size) @ weight.t(), ids.reshape(-1, k), logprobs.reshape(-1, k),
                          "reverse_kl", real_vocab_size=real).reshape(batch, seq)
    assert contribution.item() == pytest.approx((per_token * coefficients * mask).sum().item(), rel=1e-10)
