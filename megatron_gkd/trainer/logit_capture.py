"""The student's logits as the last stage's output layer makes them, kept for the loss: Megatron's ``GPTModel`` would
otherwise hand back a transposed copy of them (or, fused, never build them). :func:`capture_logits` keeps the
``[s, b, V/tp]`` shard; :func:`~megatron_gkd.models.output_layer.capture_output_layer` keeps the final hidden states
and the output weight instead; :func:`student_logits` makes either the one source every term of the loss reads.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from megatron_gkd.losses.student_logits import FusedLogits, LogitShard, StudentLogits
from megatron_gkd.models.output_layer import patch_output_layer


def capture_logits(model):
    """Keeps the last stage's logits in the output layer's own ``[s, b, V/tp]`` layout
    (``captured.logits``) and makes ``GPTModel`` return an empty ``[b, s, 0]`` placeholder.

    Without labels ``GPTModel`` returns ``logits.transpose(0, 1).contiguous()``: a copy of the largest
    tensor of the step, and in the backward a transposed gradient that the output layer copies again
    before its matmuls (most of the gap between a distillation step and a cross-entropy step).
    """
    captured = types.SimpleNamespace(logits=None)

    def make_forward(layer):
        original = layer.forward

        def forward(*args, **kwargs):
            logits, bias = original(*args, **kwargs)
            captured.logits = logits
            return logits[..., :0], bias

        return forward

    return patch_output_layer(model, captured, make_forward)


def student_logits(spec, captured: types.SimpleNamespace, output: torch.Tensor, tp_group) -> StudentLogits:
    """The source the terms of the loss read (:mod:`megatron_gkd.losses.student_logits`) from what the forward under
    :func:`capture_output_layer` (``spec.fused``) or :func:`capture_logits` kept and the model's ``output``."""
    tp_group = tp_group if dist.get_world_size(tp_group) > 1 else None
    if spec.fused:  # hidden [b, s, h] as the model returned it
        return FusedLogits(output, captured.weight, tp_group, captured.sequence_parallel, spec.chunk_size)
    return LogitShard(captured.logits, tp_group, spec.chunk_size)  # [s, b, V/tp] as the output layer made them
