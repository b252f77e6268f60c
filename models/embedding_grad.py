"""The word embedding's gradient added into Megatron DDP's ``main_grad`` row by row, never built dense.

Megatron-Core's ``VocabParallelEmbedding`` looks its rows up with ``F.embedding``, whose backward builds a dense
``[V/tp, h]`` gradient (zeros, then the rows of the tokens seen added in) that DDP's hook then adds into the weight's
``main_grad``: 0.58 GiB at 152k x 1024 in fp32, written in full twice a backward for the few hundred rows a batch
touches, and the largest tensor alive at the end of the backward. :func:`install` makes the ``F.embedding`` that
Megatron's layer calls :func:`embedding`, whose backward adds each token's gradient into ``main_grad`` at its row
(``index_add_``) and returns none, as Megatron's linear layers do with gradient-accumulation fusion and as the fused
loss does for the output layer (:class:`megatron_gkd.losses.shard_ops.WeightGrad`); a weight without ``main_grad`` (a
frozen teacher, a model outside DDP) gets ``torch.nn.functional.embedding``'s own backward. A tied output layer's
gradient still reaches the same weight through its own path.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.index_add_(0, ids.reshape(-1), rows.to(main_grad.dtype))
        return None, None


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """``torch.nn.functional.embedding``, whose backward adds into ``weight.main_grad`` when the weight has one (and
    the call uses none of the options that change the gradient)."""
    plain = (padding_idx is None and max_norm is None and not scale_grad_by_freq and not sparse)
    if plain and getattr(weight, "main_grad", None) is not None and weight.requires_grad and torch.is_grad_enabled():
        return _Embedding.apply(input, weight)
    return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


class _FunctionalView(types.ModuleType):
    """``torch.nn.functional`` with :func:`embedding` in place of its own."""

    def __init__(self):
        super().__init__("torch.nn.functional")
        self.embedding = embedding

    def __getattr__(self, name):
        return getattr(F, name)


FUNCTIONAL_VIEW = _FunctionalView()


def install() -> None:
    """Makes Megatron-Core's tensor-parallel layers (its ``VocabParallelEmbedding``) call :func:`embedding`.
    Idempotent; any platform (the dense gradient costs the same memory on an accelerator)."""
    from megatron.core.tensor_parallel import layers

    layers.F = FUNCTIONAL_VIEW
