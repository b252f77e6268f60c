"""The divergence and the sampled tokens' log-probs from one pass over the logit shard (``token_ids`` of
``vocab_parallel_distill_loss`` and of its fused twin, what the policy-gradient step uses with ``rl.combine=loss``):
the same values and the same gradient as the two separate functions, at TP=1 and TP=2, fp64 and fp32, unfused and
fused, with sampled tokens that are also teacher ids, padding rows past ``real_vocab_size`` and every divergence."""

import pytest
import torch

from megatron_gkd.losses import registered_divergences
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

N, VOCAB, REAL, K, HIDDEN = 12, 64, 61, 6, 8
LOSSES = tuple(registered_divergences())


def _inputs(dtype):
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(N, VOCAB, generator=generator, dtype=torch.float64) * 3).to(dtype)
    teacher = torch.log_softmax(torch.randn(N, REAL, generator=generator, dtype=torch.float64) * 2, -1)
    logprobs, ids = teacher.topk(K, dim=-1)
    logprobs[0, K - 2:] = float("-inf")  # padding entries
    tokens = torch.randint(0, REAL, (N,), generator=generator)
    tokens[:4] = ids[:4, 1]  # sampled tokens that the teacher also scores
    weights = torch.randn(N, generator=generator, dtype=torch.float64)
    token_weights = torch.randn(N, generator=generator, dtype=torch.float64)
    return logits, ids, logprobs.float(), tokens, weights, token_weights


def _errors(tp_group=None, rank=0, size=1) -> dict:
    from megatron_gkd.losses import (
        fused_vocab_parallel_distill_loss,
        fused_vocab_parallel_token_logprobs,
        vocab_parallel_distill_loss,
        vocab_parallel_token_logprobs,
    )

    errors = {}
    rows = slice(rank * VOCAB // size, (rank + 1) * VOCAB // size)
    for dtype in (torch.float64, torch.float32):
        logits, ids, logprobs, tokens, weights, token_weights = _inputs(dtype)
        generator = torch.Generator().manual_seed(3)
        hidden = torch.randn(N, HIDDEN, generator=generator, dtype=torch.float64).to(dtype)
        weight = (torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) * 0.7).to(dtype)
        for fused in (False, True):
            for loss_type in LOSSES:
                options = {"real_vocab_size": REAL, **({"coverage_coef": 0.5} if loss_type == "tcad" else {})}
                common = dict(loss_type=loss_type, tp_group=tp_group, temperature=1.3, **options)

                def run(together: bool):
                    leaves = [hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()] if fused \
                        else [logits[:, rows].clone().requires_grad_()]
                    riding = {"token_ids": tokens} if together else {}
                    if fused:
                        loss, metrics = fused_vocab_parallel_distill_loss(*leaves, ids, logprobs, chunk_size=5,
                                                                          **riding, **common)
                        token = metrics["token_logprobs"] if together else fused_vocab_parallel_token_logprobs(
                            *leaves, tokens, tp_group, temperature=1.3, real_vocab_size=REAL, chunk_size=5)
                    else:
                        loss, metrics = vocab_parallel_distill_loss(*leaves, ids, logprobs, **riding, **common)
                        token = metrics["token_logprobs"] if together else vocab_parallel_token_logprobs(
                            *leaves, tokens, tp_group, temperature=1.3, real_vocab_size=REAL)
                    (loss.double() @ weights + token.double() @ token_weights).backward()
                    return loss, token, torch.cat([leaf.grad.reshape(-1) for leaf in leaves]), leaves[-1].grad

                loss, token, grad, last = run(True)
                loss_apart, token_apart, grad_apart, _ = run(False)
                # ids past REAL on this rank's shard (logit columns; fused: weight rows) get no gradient
                first = max(0, REAL - rows.start) if REAL < rows.stop else rows.stop - rows.start
                padding = last[first:] if fused else last[:, first:]
                errors[(str(dtype), fused, loss_type)] = (
                    (loss - loss_apart).abs().max().item(), (token - token_apart).abs().max().item(),
                    (grad - grad_apart).abs().max().item() / grad_apart.abs().max().item(),
                    padding.abs().max().item() if padding.numel() else 0.0)
    return errors


def _body():
    import torch.distributed as dist

    return _errors(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def _check(errors):
    assert len(errors) == 2 * 2 * len(LOSSES)
    for (dtype, fused, loss_type), (loss, token, grad, padding) in errors.items():
        bound = 1e-12 if dtype == str(torch.float64) else 1e-5
        assert loss < bound and token < bound and grad < bound, (dtype, fused, loss_type, loss, token, grad)
        assert padding == 0.0, (dtype, fused, loss_type, "padding rows got a gradient")


def test_one_pass_equals_two_at_tp1():
    _check(_errors())


def test_one_pass_equals_two_at_tp2():
    for errors in run_distributed(_body, 2):
        _check(errors)
