"""The policy-gradient term and the token log-prob at TP=1: dense float64 reference, hand-worked clip regimes,
padding rows, refused inputs."""

import pytest
import torch

from megatron_gkd.losses import (
    fused_vocab_parallel_policy_gradient_loss,
    fused_vocab_parallel_token_logprobs,
    vocab_parallel_policy_gradient_loss,
    vocab_parallel_token_logprobs,
)
from megatron_gkd.losses.reference import reference_token_logprobs
from megatron_gkd.testing import policy_gradient as cases


def test_unfused_and_fused_match_the_float64_reference_tp1():
    result = cases.check_everything()
    records = result["records"]
    num_cases = len(cases.make_cases(1))
    assert len(records) == num_cases * (len(cases.UNFUSED_DTYPES) + len(cases.FUSED_DTYPES))
    assert cases.failures(records) == []
    fp64 = [max(r["loss_error"], r["grad_error"]) * cases.TOLERANCES[torch.float64]
            for r in records if r["dtype"] == str(torch.float64)]
    assert max(fp64) < 1e-13, max(fp64)  # float64 agrees to rounding, not just to the tolerance
    assert all(error < 1e-12 for error in result["mismatch"].values()), result["mismatch"]


def test_cases_reach_every_clip_regime():
    """The reference comparison means something only if tokens are clipped on both sides and by the dual clip."""
    by_name = {case.name: case for case in cases.make_cases(1)}
    for name, expect_dual in (("clip_regimes", False), ("dual_clip", True)):
        case = by_name[name]
        logits = case.hidden @ case.table.t()
        loss, metrics = vocab_parallel_policy_gradient_loss(logits, case.token_ids, case.advantages, tp_group=None,
                                                            old_logprobs=case.old_logprobs, **case.options)
        ratio, advantages, clipped = metrics["ratio"], case.advantages, metrics["clipped"].bool()
        assert (clipped & (advantages > 0) & (ratio > 1 + case.options["clip_high"])).any(), name
        assert (clipped & (advantages < 0) & (ratio < 1 - case.options["clip_low"])).any(), name
        assert (~clipped & (advantages != 0)).any(), name
        dual = clipped & (advantages < 0) & (ratio > case.options.get("clip_ratio_c", float("inf")))
        assert bool(dual.any()) == expect_dual, name


def test_clip_regimes_by_hand():
    """One token per regime on a 2-id vocabulary; the expected loss and d loss / d log pi are worked by hand."""
    logits = torch.zeros(6, 2, dtype=torch.float64, requires_grad=True)  # log pi(y) = log 0.5 everywhere
    tokens = torch.zeros(6, dtype=torch.long)
    logp = torch.log(torch.tensor(0.5, dtype=torch.float64))
    ratios = torch.tensor([1.1, 1.5, 0.5, 0.9, 5.0, 2.5], dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -2.0], dtype=torch.float64)
    loss, metrics = vocab_parallel_policy_gradient_loss(
        logits, tokens, advantages, tp_group=None, old_logprobs=logp - ratios.log(), clip_low=0.2, clip_high=0.3,
        clip_ratio_c=3.0,
    )
    # inside | above 1.3 with A > 0 | below 0.8 with A < 0 | inside | dual clip at c = 3 | A = -2, ratio 2.5 < c
    expected = torch.tensor([-1.1, -1.3, 0.8, 0.9, 3.0, 5.0], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert metrics["clipped"].tolist() == [0, 1, 1, 0, 1, 0]
    loss.sum().backward()
    # d loss / d logit of y = (-A ratio where not clipped) x (1 - pi(y)) = -A ratio / 2
    d_logp = torch.tensor([-1.1, 0.0, 0.0, 0.9, 0.0, 5.0], dtype=torch.float64)
    torch.testing.assert_close(logits.grad[:, 0], d_logp / 2, rtol=0, atol=1e-12)


def test_truncated_importance_weight_is_capped_and_detached():
    logits = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 1, 2])
    logp = torch.log(torch.tensor(0.25, dtype=torch.float64))
    behaviour = logp - torch.tensor([0.1, 1.0, -0.5], dtype=torch.float64)  # pi_old / pi_behaviour = e^0.1, e, e^-0.5
    loss, metrics = vocab_parallel_policy_gradient_loss(logits, tokens, torch.ones(3, dtype=torch.float64),
                                                        tp_group=None, behaviour_logprobs=behaviour, tis_cap=2.0)
    weight = torch.tensor([0.1, 1.0, -0.5], dtype=torch.float64).exp().clamp(max=2.0)
    torch.testing.assert_close(metrics["tis_weight"], weight)
    torch.testing.assert_close(loss, -weight)  # on-policy ratio 1
    loss.sum().backward()
    # gradient of -w log pi(y) w.r.t. the logits: -w (onehot - 1/4); nothing flows through the weight
    expected = -weight[:, None] * (torch.eye(4, dtype=torch.float64)[tokens] - 0.25)
    torch.testing.assert_close(logits.grad, expected)


def test_token_logprobs_gradcheck_with_padding_rows():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 12, generator=generator, dtype=torch.float64)
    logits[:, 9:] += 6.0  # padding rows with the largest logits
    logits.requires_grad_()
    tokens = torch.tensor([0, 8, 3, 3, 7])
    found = vocab_parallel_token_logprobs(logits, tokens, None, temperature=0.8, real_vocab_size=9)
    torch.testing.assert_close(found, reference_token_logprobs(logits.detach(), tokens, 0.8, 9), rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_token_logprobs(x, tokens, None, temperature=0.8, real_vocab_size=9), (logits,))
    found.sum().backward()
    assert bool((logits.grad[:, 9:] == 0).all())
    hidden = torch.randn(5, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: fused_vocab_parallel_token_logprobs(h, w, tokens, None, real_vocab_size=9, chunk_size=2),
        (hidden, weight))


def test_fused_accepts_sbh_layout_and_bf16():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 8, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(32, 8, generator=generator).bfloat16().requires_grad_()
    tokens = torch.randint(0, 32, (3, 4), generator=generator)
    loss, metrics = fused_vocab_parallel_policy_gradient_loss(
        hidden, weight, tokens, torch.randn(3, 4, generator=generator), tp_group=None, chunk_size=5,
        behaviour_logprobs=torch.full((3, 4), -3.0), tis_cap=2.0,
    )
    loss.sum().backward()
    assert loss.shape == (3, 4) and loss.dtype == torch.float32 and metrics["tis_weight"].shape == (3, 4)
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(hidden.grad.float()).all() and weight.grad.abs().sum() > 0


def test_refuses_malformed_inputs():
    logits, tokens, advantages = torch.randn(4, 16), torch.tensor([0, 1, 2, 3]), torch.ones(4)

    def call(**kwargs):
        arguments = dict(token_ids=tokens, advantages=advantages, tp_group=None)
        arguments.update(kwargs)
        return vocab_parallel_policy_gradient_loss(logits, **arguments)

    with pytest.raises(ValueError, match="did you mean 'clip_high'"):
        call(clip_hihg=0.3)
    with pytest.raises(ValueError, match="clip_low"):
        call(clip_low=1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        call(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        call(tis_cap=2.0)
    with pytest.raises(ValueError, match="must be tokens"):
        call(real_vocab_size=3)  # token 3 is a padding row
    with pytest.raises(ValueError, match="integer"):
        call(token_ids=tokens.float())
    with pytest.raises(ValueError, match="one id per row"):
        call(token_ids=tokens[:3])
    with pytest.raises(ValueError, match="one value per token"):
        call(advantages=advantages[:3])
    with pytest.raises(ValueError, match="old_logprobs are positive"):
        call(old_logprobs=torch.full((4,), 0.5))
    with pytest.raises(ValueError, match="old_logprobs are not finite"):
        call(old_logprobs=torch.tensor([-1.0, float("-inf"), -1.0, -1.0]))
    with pytest.raises(ValueError, match="behaviour_logprobs have NaN"):
        call(behaviour_logprobs=torch.tensor([-1.0, float("nan"), -1.0, -1.0]))
    with pytest.raises(ValueError, match="advantages are not finite"):
        call(advantages=torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    with pytest.raises(ValueError, match=r"\[V/tp, h\]"):
        fused_vocab_parallel_policy_gradient_loss(torch.randn(4, 8), torch.randn(8, 16), tokens, advantages,
                                                  tp_group=None)
