"""SDPAttention against a float64 loop-over-heads reference (MLA head sizes, GQA/MQA, masks)."""

import math
import types

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_gkd.models.attention import SDPAttention

_SINGLE_RANK = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


def _config(heads: int, groups: int, **overrides) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **overrides,
    )


def _attention(heads, groups, mask_type=AttnMaskType.causal, **kwargs) -> SDPAttention:
    return SDPAttention(
        _config(heads, groups),
        layer_number=1,
        attn_mask_type=mask_type,
        attention_type="self",
        pg_collection=_SINGLE_RANK,
        **kwargs,
    )


def _reference(query, key, value, scale, masked):
    """Dense float64 attention, one head at a time; ``masked[b, i, j]`` True hides key j from query i."""
    sq, b, heads, _ = query.shape
    groups = key.shape[2]
    out = torch.zeros(sq, b, heads, value.shape[-1], dtype=torch.float64)
    for batch in range(b):
        for head in range(heads):
            group = head // (heads // groups)
            q = query[:, batch, head].double()
            k = key[:, batch, group].double()
            v = value[:, batch, group].double()
            scores = (q @ k.T) * scale
            scores = scores.masked_fill(masked[batch], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            out[:, batch, head] = probs @ v
    return out.reshape(sq, b, heads * value.shape[-1])


def _causal(b, sq, sk):
    keys = torch.arange(sk)[None, :]
    queries = torch.arange(sq)[:, None] + (sk - sq)
    return (keys > queries).expand(b, sq, sk)


@pytest.mark.parametrize(
    "heads,groups,k_channels,v_channels",
    [(4, 4, 48, 32), (4, 2, 40, 40), (4, 1, 32, 64)],
    ids=["mha-mla-dims", "gqa", "mqa"],
)
def test_causal_matches_float64_reference(heads, groups, k_channels, v_channels):
    torch.manual_seed(0)
    sq, b = 7, 3
    scale = 0.37
    attention = _attention(heads, groups, k_channels=k_channels, v_channels=v_channels, softmax_scale=scale)
    query = torch.randn(sq, b, heads, k_channels, dtype=torch.float64, requires_grad=True)
    key = torch.randn(sq, b, groups, k_channels, dtype=torch.float64, requires_grad=True)
    value = torch.randn(sq, b, groups, v_channels, dtype=torch.float64, requires_grad=True)

    out = attention(query, key, value, attention_mask=None)
    expected = _reference(query, key, value, scale, _causal(b, sq, sq))
    assert out.shape == (sq, b, heads * v_channels)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)

    weights = torch.randn_like(expected)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_default_scale_is_inverse_sqrt_of_key_head_size():
    attention = _attention(2, 2, k_channels=48, v_channels=16)
    assert attention.softmax_scale == pytest.approx(1.0 / math.sqrt(48))


def test_explicit_mask_replaces_causal_and_fully_masked_rows_are_zero():
    torch.manual_seed(1)
    sq, b, heads = 5, 2, 2
    attention = _attention(heads, heads, k_channels=32, v_channels=32)
    query, key, value = (torch.randn(sq, b, heads, 32, dtype=torch.float64) for _ in range(3))
    masked = torch.rand(b, sq, sq) < 0.4
    masked[0, 2] = True  # query 2 of sample 0 sees nothing
    out = attention(query, key, value, attention_mask=masked[:, None])
    expected = _reference(query, key, value, 1.0 / math.sqrt(32), masked)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.all(out.reshape(sq, b, heads, 32)[2, 0] == 0)


def test_causal_with_fewer_queries_than_keys_aligns_to_the_last_key():
    torch.manual_seed(2)
    sq, sk, b, heads = 3, 8, 1, 2
    attention = _attention(heads, heads, k_channels=32, v_channels=32)
    query = torch.randn(sq, b, heads, 32, dtype=torch.float64)
    key, value = (torch.randn(sk, b, heads, 32, dtype=torch.float64) for _ in range(2))
    out = attention(query, key, value, attention_mask=None)
    expected = _reference(query, key, value, 1.0 / math.sqrt(32), _causal(b, sq, sk))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_no_mask_type_attends_everywhere():
    torch.manual_seed(3)
    attention = _attention(2, 2, mask_type=AttnMaskType.no_mask, k_channels=32, v_channels=32)
    query, key, value = (torch.randn(4, 1, 2, 32, dtype=torch.float64) for _ in range(3))
    out = attention(query, key, value, attention_mask=None)
    expected = _reference(query, key, value, 1.0 / math.sqrt(32), torch.zeros(1, 4, 4, dtype=torch.bool))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_unsupported_settings_fail_with_a_message():
    with pytest.raises(ValueError, match="sliding-window"):
        SDPAttention(
            _config(2, 2, window_size=(4, 0)),
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            pg_collection=_SINGLE_RANK,
        )
    attention = _attention(2, 2, k_channels=32, v_channels=32)
    tensors = [torch.randn(2, 1, 2, 32) for _ in range(3)]
    with pytest.raises(ValueError, match="packed"):
        attention(*tensors, attention_mask=None, packed_seq_params=object())
