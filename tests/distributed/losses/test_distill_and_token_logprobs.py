"""The divergence and the sampled tokens' log-probs from one pass over the logit shard (``token_ids`` of
``vocab_parallel_distill_loss``, what the policy-gradient step uses with ``rl.combine=loss``): the same values and
the same gradient as the two separate functions, at TP=1 and TP=2, fp64 and fp32, with sampled tokens that are also
teacher ids, padding rows past ``real_vocab_size`` and every divergence."""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

N, VOCAB, REAL, K = 12, 64, 61, 6
LOSSES = ("forward_kl", "reverse_kl", "jsd", "kl_rkl", "tcad")


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
    from megatron_gkd.losses import vocab_parallel_distill_loss, vocab_parallel_token_logprobs

    errors = {}
    for dtype in (torch.float64, torch.float32):
        logits, ids, logprobs, tokens, weights, token_weights = _inputs(dtype)
        shard = logits[:, rank * VOCAB // size:(rank + 1) * VOCAB // size]
        for loss_type in LOSSES:
            options = {"real_vocab_size": REAL, **({"coverage_coef": 0.5} if loss_type == "tcad" else {})}
            together = shard.clone().requires_grad_()
            loss, metrics = vocab_parallel_distill_loss(together, ids, logprobs, loss_type=loss_type, tp_group=tp_group,
                                                        temperature=1.3, token_ids=tokens, **options)
            (loss.double() @ weights + metrics["token_logprobs"].double() @ token_weights).backward()
            apart = shard.clone().requires_grad_()
            loss_apart, _ = vocab_parallel_distill_loss(apart, ids, logprobs, loss_type=loss_type, tp_group=tp_group,
                                                        temperature=1.3, **options)
            token_apart = vocab_parallel_token_logprobs(apart, tokens, tp_group, temperature=1.3, real_vocab_size=REAL)
            (loss_apart.double() @ weights + token_apart.double() @ token_weights).backward()
            scale = apart.grad.abs().max().item()
            errors[(str(dtype), loss_type)] = (
                (loss - loss_apart).abs().max().item(), (metrics["token_logprobs"] - token_apart).abs().max().item(),
                (together.grad - apart.grad).abs().max().item() / scale, together.grad[:, max(0, REAL - rank * VOCAB // size):].abs().max().item()
                if REAL < (rank + 1) * VOCAB // size else 0.0)
    return errors


def _body():
    import torch.distributed as dist

    return _errors(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def _check(errors):
    for (dtype, loss_type), (loss, token, grad, padding) in errors.items():
        bound = 1e-12 if dtype == str(torch.float64) else 1e-5
        assert loss < bound and token < bound and grad < bound, (dtype, loss_type, loss, token, grad)
        assert padding == 0.0, (dtype, loss_type, "padding rows got a gradient")


def test_one_pass_equals_two_at_tp1():
    _check(_errors())


def test_one_pass_equals_two_at_tp2():
    for errors in run_distributed(_body, 2):
        _check(errors)
