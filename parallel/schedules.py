"""Megatron's pipeline schedules, called one way: micro-batches in, per-micro-batch results out.

:func:`run_schedule` is the one place that calls ``get_forward_backward_func()``: the trainer's step, the
Megatron teacher, evaluation and weight-sync verification all go through it. :func:`forward_logits`
is the forward-only call that returns full-vocabulary logits (tests, verification, small evals).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

from megatron_gkd import platform
from megatron_gkd.parallel.shards import gather_tp


@contextlib.contextmanager
def eval_mode(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Puts ``chunks`` in eval mode and restores the mode each one had (a training student stays training)."""
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, training in zip(chunks, modes):
            chunk.train(training)


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    forward_step: Callable,
    microbatches: Sequence,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list:
    """Runs ``microbatches`` through this rank's chunks with Megatron's schedule for the layout.

    Every rank of the model calls it with the same number of micro-batches (pipeline p2p and TP/EP
    collectives). With virtual pipeline stages each chunk pulls every micro-batch in turn, so each
    chunk gets its own iterator over the same list.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage).
        forward_step: Megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)``.
        microbatches: whatever ``forward_step`` reads with ``next(data_iterator)``.
        seq_length, micro_batch_size: the shape of the activations exchanged between pipeline stages
            (with ``config.variable_seq_lengths`` the schedule exchanges shapes instead).
        forward_only: no backward pass.

    Returns:
        On the last pipeline stage, what each micro-batch's loss function returned as its second
        value, in order; elsewhere an empty list.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def forward_logits(chunks: Sequence[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits ``[b, s, v]`` on the last pipeline stage, ``None`` elsewhere.

    A collective over the model (pipeline p2p, TP / EP): every rank calls it with the same tokens. One
    micro-batch per sequence; no gradients; the chunks' train/eval modes are restored afterwards. The
    tokens may be on the host: they go to the platform's device, where the logits stay.
    """
    from megatron.core import parallel_state as mpu

    tokens = tokens.to(platform.device())
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0)

    def keep_logits(output):
        return output.sum() * 0.0, {"logits": output.detach().clone()}

    def forward_step(data_iterator, model):
        return model(next(data_iterator), position_ids, attention_mask=None), keep_logits

    with eval_mode(chunks), torch.no_grad():
        outputs = run_schedule(chunks, forward_step, [tokens[i : i + 1] for i in range(batch)],
                               seq_length=seq, micro_batch_size=1, forward_only=True)
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = torch.cat([entry["logits"] for entry in outputs], dim=0)  # [b, s, v/tp]
    return gather_tp(local, -1, mpu.get_tensor_model_parallel_group())
