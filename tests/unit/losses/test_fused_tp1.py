"""Fused chunked path at TP=1: same values and gradients as the unfused path and the reference."""

import pytest
import torch

from megatron_gkd.losses import fused_vocab_parallel_distill_loss
from megatron_gkd.testing import losses as cases


def test_fused_matches_unfused_and_reference_tp1():
    errors = cases.check_fused_against_unfused(chunk_size=5)
    fp32 = {key: value for key, value in errors.items() if "float32" in key}
    fp64 = {key: value for key, value in errors.items() if "float64" in key}
    assert len(fp32) == len(cases.LOSS_CONFIGS) * (1 + len(cases.padding_cases(64, 1)))  # equal and padded tables
    assert max(fp32.values()) <= 1e-5, fp32
    assert max(fp64.values()) <= 1e-10, fp64


def test_fused_accepts_sbh_layout_and_bf16():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 8, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(32, 8, generator=generator).bfloat16().requires_grad_()
    teacher = torch.log_softmax(torch.randn(3, 4, 32, generator=generator), -1)
    logprobs, ids = teacher.topk(5, -1)
    loss, metrics = fused_vocab_parallel_distill_loss(
        hidden, weight, ids, logprobs, loss_type="forward_kl", tp_group=None, chunk_size=5
    )
    loss.sum().backward()
    assert loss.shape == (3, 4) and metrics["teacher_mass"].shape == (3, 4)
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(hidden.grad.float()).all() and weight.grad.abs().sum() > 0


def test_fused_rejects_bad_options():
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    ids, logprobs = torch.zeros(4, 2, dtype=torch.long), torch.full((4, 2), -1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_vocab_parallel_distill_loss(hidden, weight, ids, logprobs, loss_type="forward_kl",
                                          tp_group=None, chunk_size=0)
    with pytest.raises(ValueError, match=r"\[V/tp, h\]"):
        fused_vocab_parallel_distill_loss(hidden, weight.t(), ids, logprobs, loss_type="forward_kl",
                                          tp_group=None)


def test_fused_refuses_diagnostics():
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    ids, logprobs = torch.zeros(4, 2, dtype=torch.long), torch.full((4, 2), -1.0)
    with pytest.raises(ValueError, match="diagnostics"):
        fused_vocab_parallel_distill_loss(hidden, weight, ids, logprobs, loss_type="forward_kl",
                                          tp_group=None, diagnostics=True)


def _tied_loss(hidden, weight, ids, logprobs, tokens, inputs):
    """A fused distillation term, a fused policy-gradient log-prob term and an embedding lookup, all on one weight (a
    tied output layer, as SmolLM2's)."""
    from megatron_gkd.losses import fused_vocab_parallel_token_logprobs

    loss, _ = fused_vocab_parallel_distill_loss(hidden, weight, ids, logprobs, loss_type="reverse_kl", tp_group=None,
                                                chunk_size=3)
    token_logprobs = fused_vocab_parallel_token_logprobs(hidden, weight, tokens, None, chunk_size=4)
    embedded = torch.nn.functional.embedding(inputs, weight)
    return loss.sum() - 0.7 * token_logprobs.sum() + (embedded ** 2).sum()


def test_fused_backward_adds_the_weight_gradient_into_ddp_main_grad():
    """Under Megatron's DDP a weight carries ``main_grad``: the fused backward adds its weight gradient there and
    returns none (no second ``[V/tp, h]`` tensor at the backward's peak), while the other paths to the same weight (the
    tied embedding's lookup) still return theirs; together they are the gradient of the plain backward."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(32, 8, generator=generator, dtype=torch.float64)
    logprobs, ids = torch.log_softmax(torch.randn(10, 32, generator=generator, dtype=torch.float64), -1).topk(5, -1)
    tokens = torch.randint(0, 32, (10,), generator=generator)
    inputs = torch.randint(0, 32, (6,), generator=generator)

    plain_hidden, plain_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    _tied_loss(plain_hidden, plain_weight, ids, logprobs, tokens, inputs).backward()

    ddp_hidden, ddp_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    earlier = torch.randn(32, 8, generator=generator, dtype=torch.float64)  # an earlier micro-batch's gradient
    ddp_weight.main_grad = earlier.clone()
    _tied_loss(ddp_hidden, ddp_weight, ids, logprobs, tokens, inputs).backward()

    lookup = torch.zeros_like(weight).index_add_(0, inputs, 2 * weight[inputs])
    torch.testing.assert_close(ddp_weight.grad, lookup, rtol=0, atol=1e-12)  # the lookup's alone
    torch.testing.assert_close(ddp_weight.main_grad + ddp_weight.grad, earlier + plain_weight.grad, rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(ddp_hidden.grad, plain_hidden.grad, rtol=0, atol=0)
