"""Whether the hidden signal's head and hidden states are the teacher's (``teacher.signal=hidden``).

With the hidden signal the trainer recomputes the teacher's logits as ``hidden @ head``, the head read from
``teacher.head_checkpoint``. Shape checks cannot tell the served teacher's output layer from that of another model
of the same shape (another seed, a sibling fine-tune), nor sane hidden states from finite but absurd ones (a row
scaled by 1e4): both train on a plausible loss towards the wrong distribution. What can tell is the teacher's own
log-prob of each sampled token, which every hidden reply carries (``token_logprobs``, at the teacher's temperature):
:func:`check_teacher_head` recomputes it for a sample of tokens from ``hidden @ head_shard`` (vocab-parallel,
:func:`~megatron_gkd.losses.hidden_token_logprobs`) and refuses a disagreement past ``teacher.head_check_tolerance``.

Measured on the tiny assets' teacher (``megatron_gkd/recipes/tiny.py``, float32, bf16 hidden states on the wire,
logits up to 15, temperatures 1 and 1.5, fp32 and bf16 heads, TP=1 and 2): the right head disagrees by at most
0.04 nats per token (0.003-0.01 on average); with its output layer scaled so that logits reach 58 and 116, by at
most 0.23 and 0.47 (bf16 rounding grows with ``|logit| / temperature``; a bf16 teacher agreed exactly). The head
of the same model with another seed disagrees by 5.5-16.6 nats at most (2.2-3.8 on average, most tokens past 1
nat), and a hidden row scaled by 1e4 by 2.6e4-1.4e5 nats on its token. The default tolerance, 1 nat per token,
lies between.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_gkd.losses import hidden_token_logprobs
from megatron_gkd.teacher.protocol.types import Signal
from megatron_gkd.trainer.batch import Sample, TeacherRows

HEAD_CHECK_TOKENS = 64
"""Tokens a check recomputes: their ``[64, V/tp]`` logits, a small part of what the loss computes every step."""


class TeacherHeadMismatch(ValueError):
    """The teacher's hidden states through the run's head do not give the log-probs the teacher sent."""


@dataclasses.dataclass(frozen=True, slots=True)
class HeadAgreement:
    """How far ``hidden @ head`` is from the teacher's own token log-probs on the checked tokens, in nats.

    Attributes:
        max_nats: the largest disagreement of one token.
        mean_nats: the mean over the checked tokens.
        num_tokens: tokens checked.
        num_over: tokens past the tolerance.
        worst: the worst token's row in the teacher's rows.
    """

    max_nats: float
    mean_nats: float
    num_tokens: int
    num_over: int
    worst: int

    def describe(self, tolerance: float) -> str:
        if not self.num_over:
            return (f"{self.num_tokens} tokens agree with the teacher's log-probs within {self.max_nats:.3g} nats "
                    f"(mean {self.mean_nats:.3g}; tolerance {tolerance:g})")
        return (f"up to {self.max_nats:.4g} nats (mean {self.mean_nats:.4g}; {self.num_over} of {self.num_tokens} "
                "checked tokens past the tolerance)")


def check_due(config, step: int, *, first: bool, scoring: bool) -> bool:
    """Whether a batch checks the head of teacher section ``config``: the hidden signal, on the run's first batch
    (an evaluation's or a step's) and on steps that are multiples of ``head_check_interval``."""
    interval = config.head_check_interval
    return Signal(config.signal).needs_head and (first or (not scoring and interval > 0 and step % interval == 0))


def where(step: int) -> str:
    """Which batch a check ran on, for messages (evaluation batches have step -1)."""
    return f"at step {step}" if step >= 0 else "on an evaluation batch"


def sample_rows(num_rows: int, step: int, num_tokens: int = HEAD_CHECK_TOKENS) -> torch.Tensor:
    """``min(num_rows, num_tokens)`` distinct rows, drawn from the step (the same on every rank of a TP group)."""
    generator = torch.Generator().manual_seed(1_000_003 * max(step, 0) + 17)
    return torch.randperm(num_rows, generator=generator)[:num_tokens].sort().values


def head_agreement(rows: TeacherRows, token_ids: torch.Tensor, head: torch.Tensor, *, tp_group, temperature: float,
                   real_vocab_size: int, tolerance: float, step: int) -> HeadAgreement:
    """Disagreement of ``hidden @ head`` with ``rows.token_logprobs`` on a sample of the rows (collective over TP:
    every rank of ``tp_group`` passes the same rows and its own head shard).

    Args:
        rows: the teacher's rows of some samples (``hidden`` set).
        token_ids: ``[N]`` the response token each row predicts.
        head: ``[V/tp, h_t]`` this rank's shard of the teacher's output layer.
        tp_group: the tensor-parallel group (None: the vocabulary is not split).
        temperature: the teacher's temperature (its ``token_logprobs`` are at it, as the loss's teacher is).
        real_vocab_size: ids at or past it are padding rows.
        tolerance: nats; tokens past it are counted.
        step: the step, which draws the sample.
    """
    assert rows.hidden is not None and len(token_ids) == len(rows.token_logprobs), "rows of the hidden signal"
    chosen = sample_rows(len(token_ids), step)
    recomputed = hidden_token_logprobs(rows.hidden[chosen].to(head.device), head, token_ids[chosen].to(head.device),
                                       tp_group=tp_group, teacher_temperature=temperature,
                                       real_vocab_size=real_vocab_size)
    gap = (recomputed.double().cpu() - rows.token_logprobs[chosen].double()).abs()
    if not len(gap):
        return HeadAgreement(0.0, 0.0, 0, 0, 0)
    # NaN (an overflowing row) counts as the worst possible disagreement.
    gap = torch.nan_to_num(gap, nan=float("inf"))
    worst = int(gap.argmax())
    return HeadAgreement(float(gap[worst]), float(gap.mean()), len(gap), int((gap > tolerance).sum()),
                         int(chosen[worst]))


def check_teacher_head(rows: TeacherRows, samples: list[Sample], head: torch.Tensor, *, key: str, config, tp_group,
                       real_vocab_size: int, step: int) -> HeadAgreement:
    """:func:`head_agreement` of the teacher section ``config`` (at ``key``: ``teacher`` or ``teachers.NAME``) on
    its rows of ``samples`` (collective over ``tp_group``).

    Raises:
        TeacherHeadMismatch: a checked token disagrees by more than ``head_check_tolerance``; the message names
            ``head_checkpoint``, the measured disagreement, the tolerance and the worst token.
    """
    tolerance = config.head_check_tolerance
    token_ids = torch.cat([sample.tokens[sample.prompt_len:] for sample in samples])
    found = head_agreement(rows, token_ids, head, tp_group=tp_group, temperature=config.temperature,
                           real_vocab_size=real_vocab_size, tolerance=tolerance, step=step)
    if found.max_nats <= tolerance:
        return found
    source = config.head_source
    named = (f"{key}.head_checkpoint={source}" if config.head_checkpoint is not None
             else f"{key}.head_checkpoint (unset: the head comes from {source})")
    ends = torch.tensor([sample.response_len for sample in samples]).cumsum(0)
    index = int(torch.searchsorted(ends, found.worst, right=True))
    token = found.worst - (int(ends[index - 1]) if index else 0)
    raise TeacherHeadMismatch(
        f"{named}: the teacher's hidden states through this output layer give its sampled tokens log-probs that "
        f"disagree with the log-probs the teacher itself sent by {found.describe(tolerance)} {where(step)}; the check "
        f"allows {tolerance:g} nats ({key}.head_check_tolerance). Either the head is not the served teacher's "
        f"output layer (another model, even one of the same shape: point {key}.head_checkpoint at the served "
        f"teacher's checkpoint), or the teacher sends corrupt hidden states (then few tokens are off; the worst is "
        f"response token {token} of prompt {samples[index].prompt_index})")
