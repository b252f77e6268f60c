"""Checks of the tail bucket (``tail_bucket=True``, :mod:`megatron_gkd.losses.tail`) against the dense float64
reference :func:`~megatron_gkd.losses.reference.reference_tail_distill_loss`, on every rank of a TP group or at TP=1.

Every divergence with a tail form, fp64 and fp32, unfused (logit shard) and fused (hidden states and the output
weight's rows), tables with padding rows past ``real_vocab_size`` (holding the largest logits, so mass or gradient
left on them shows; at TP > 1 also a shard of padding only), and teacher rows that test the edges: padding entries,
a fully padded row, a top-k holding almost all the student's mass (its tail ~1e-10), a teacher whose top-k sums to 1
within rounding (its tail floored) and one whose top-k sums a little past 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gkd.losses import fused_vocab_parallel_distill_loss, vocab_parallel_distill_loss
from megatron_gkd.losses.reference import reference_tail_distill_loss
from megatron_gkd.testing.divergence_cases import divergence_cases

TAIL_LOSSES: list[tuple[str, dict]] = divergence_cases(lambda divergence: not divergence.student_support)
NUM_TOKENS, VOCAB, K, HIDDEN, TEMPERATURE = 14, 64, 6, 8, 0.8
PEAKED_SCALE = 9.0  # row 3's hidden state is scaled by it: its student tail is ~1e-10, below float32's 1 - sum(q)
# Relative to the largest reference value, for the loss and the gradient. float32: row 3's logits lie ~30 nats apart,
# which costs reverse_kl's gradient ~5e-5 of its largest value (the same without the tail bucket).
BOUNDS = {"torch.float64": 1e-10, "torch.float32": 2e-4}


def real_vocab_sizes(tp_size: int) -> list[int | None]:
    """Every row a token; padding rows in the last shard; at TP > 1 a last shard of padding only."""
    sizes = [None, VOCAB - 5]
    if tp_size > 1:
        sizes.append(VOCAB - VOCAB // tp_size - 3)
    return sizes


def make_inputs(real: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float64 hidden states, output weight, logits and a teacher row set over the first ``real`` ids."""
    generator = torch.Generator().manual_seed(seed)
    tokens = VOCAB if real is None else real
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    weight = 0.7 * torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    hidden[:, 0] = 1.0
    weight[tokens:, 0] += 6.0  # padding rows: the largest logits
    hidden[3] *= PEAKED_SCALE  # row 3: the student holds almost all its mass on its top-k
    logits = hidden @ weight.t()
    teacher = torch.log_softmax(logits[:, :tokens] / PEAKED_SCALE ** (torch.arange(NUM_TOKENS) == 3)[:, None]
                                + 1.5 * torch.randn(NUM_TOKENS, tokens, generator=generator, dtype=torch.float64), -1)
    logprobs, ids = teacher.topk(K, dim=-1)
    ids[3] = logits[3, :tokens].topk(K).indices  # ... and the teacher scores those ids: the student's tail is tiny
    logprobs[3] = teacher[3, ids[3]]
    logprobs[1, K // 2:] = float("-inf")  # padding entries, with ids that are not tokens
    ids[1, -1] = -1
    logprobs[2] = float("-inf")  # a fully padded row
    # Row 4: the teacher's top-k holds all its mass up to rounding (tail floored); row 5: a little past 1.
    peaked = torch.log_softmax(torch.cat([torch.zeros(K, dtype=torch.float64),
                                          torch.full((tokens - K,), -60.0, dtype=torch.float64)]), 0)
    logprobs[4] = peaked[:K]
    logprobs[5] = peaked[:K] + 1e-7
    ids[5] = ids[4]
    return {"hidden": hidden, "weight": weight, "logits": logits, "ids": ids, "logprobs": logprobs.float(),
            "upstream": torch.randn(NUM_TOKENS, generator=generator, dtype=torch.float64)}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)


def tail_errors(tp_group=None, rank: int = 0, tp_size: int = 1) -> dict:
    """Body for ``run_distributed`` (or a direct call at TP=1): ``{(real, loss, dtype, path): (loss error, gradient
    error, largest gradient on a padding row)}``, errors relative to the float64 reference."""
    errors = {}
    columns = slice(rank * VOCAB // tp_size, (rank + 1) * VOCAB // tp_size)
    for real in real_vocab_sizes(tp_size):
        data = make_inputs(real)
        first_padding = VOCAB if real is None else max(0, min(columns.stop, real) - columns.start)
        for loss_type, options in TAIL_LOSSES:
            common = dict(loss_type=loss_type, tp_group=tp_group, temperature=TEMPERATURE, real_vocab_size=real,
                          tail_bucket=True, **options)
            for dtype in (torch.float64, torch.float32):
                # The reference sees the inputs rounded to the dtype, as the loss does.
                hidden_r = data["hidden"].to(dtype).to(torch.float64, copy=True).requires_grad_()
                weight_r = data["weight"].to(dtype).to(torch.float64, copy=True).requires_grad_()
                expected = reference_tail_distill_loss(hidden_r @ weight_r.t(), data["ids"], data["logprobs"],
                                                       loss_type, TEMPERATURE, real_vocab_size=real, **options)
                (expected * data["upstream"]).sum().backward()
                full_logits = data["logits"].to(dtype).to(torch.float64, copy=True).requires_grad_()
                expected_logits = reference_tail_distill_loss(full_logits, data["ids"], data["logprobs"], loss_type,
                                                              TEMPERATURE, real_vocab_size=real, **options)
                (expected_logits * data["upstream"]).sum().backward()
                shard = data["logits"][:, columns].to(dtype, copy=True).requires_grad_()
                loss, _ = vocab_parallel_distill_loss(shard, data["ids"], data["logprobs"], **common)
                (loss.double() * data["upstream"]).sum().backward()
                errors[(real, loss_type, str(dtype), "unfused")] = (
                    _relative(loss, expected_logits.detach()), _relative(shard.grad, full_logits.grad[:, columns]),
                    shard.grad[:, first_padding:].abs().max().item() if first_padding < shard.shape[1] else 0.0)
                hidden = data["hidden"].to(dtype, copy=True).requires_grad_()
                weight = data["weight"][columns].to(dtype, copy=True).requires_grad_()
                loss, _ = fused_vocab_parallel_distill_loss(hidden, weight, data["ids"], data["logprobs"],
                                                            chunk_size=5, **common)
                (loss.double() * data["upstream"]).sum().backward()
                errors[(real, loss_type, str(dtype), "fused")] = (
                    _relative(loss, expected.detach()),
                    max(_relative(hidden.grad, hidden_r.grad), _relative(weight.grad, weight_r.grad[columns])),
                    weight.grad[first_padding:].abs().max().item() if first_padding < weight.shape[0] else 0.0)
    return errors


def tail_errors_distributed() -> dict:
    """:func:`tail_errors` on the default group (the body ``run_distributed`` calls by name)."""
    return tail_errors(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def failures(errors: dict) -> list:
    """The checks whose loss or gradient is off by more than its dtype's bound, or that left a gradient on a padding
    row."""
    return [(key, value) for key, value in errors.items()
            if not (max(value[0], value[1]) <= BOUNDS[key[2]] and value[2] == 0.0)]
