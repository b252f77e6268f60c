"""From sampled responses and teacher rows to Megatron micro-batches (pure tensor code, no collectives).

Alignment (docs/design.md, "Data contracts"): a sample is ``prompt + response`` (``P + R`` tokens); the model
reads its first ``P + R - 1`` tokens, and the logits at position ``p`` predict token ``p + 1``, so
response token ``t`` (position ``P + t``) is predicted at position ``P + t - 1``: the loss mask covers
positions ``P - 1 .. P + R - 2`` and the teacher row that predicts response token ``t`` sits at
position ``P - 1 + t``.

Normalisation: every loss token carries a coefficient fixed over the *whole global batch* before it is
cut into micro-batches (``1 / N`` for the token mean; ``w_i / (R_i G)`` with TCAD's confidence weights
``w_i``, which sum to 1 over each of the ``G`` prompt groups). A micro-batch contributes
``sum(coefficient x loss)``, so the loss and gradients of a step do not depend on how it is split into
micro-batches or data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from megatron_gkd.losses import tcad_sequence_weights, tcad_support
from megatron_gkd.teacher import ScoreBatch, SequenceRequest, TeacherOutput


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One response of a step.

    Attributes:
        tokens: ``[P + R]`` int64, prompt then response.
        prompt_len: ``P``.
        group: the prompt group (the ``n`` samples of one prompt share it).
        prompt_index: the prompt's row in its dataset (what was trained, for logs and resume checks).
        student_topk: ``[R, k]`` int64 student top-k ids per response position (TCAD), or None.
        data_group: the record's ``data.group_key`` value (its task: it routes the sample to a teacher), or None.
        logprobs: ``[R]`` float32 the rollout engine's (raw) log-probs of the response tokens, or None.
        source: where the response comes from: ``student`` (sampled by the rollout engine), ``dataset`` (the
            record's own) or ``teacher`` (written by the teacher; ``sample_mix``).
        versions: ``[R]`` int64 the weight version that sampled each response token (partial rollouts), or None.
    """

    tokens: torch.Tensor
    prompt_len: int
    group: int
    prompt_index: int
    student_topk: torch.Tensor | None = None
    data_group: str | None = None
    logprobs: torch.Tensor | None = None
    source: str = "student"
    versions: torch.Tensor | None = None

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def input_len(self) -> int:
        """Tokens the model reads (the last token predicts nothing)."""
        return len(self.tokens) - 1


@dataclasses.dataclass(slots=True)
class TeacherRows:
    """The teacher's rows of a list of samples, concatenated: row ``offsets[i] + t`` predicts response
    token ``t`` of sample ``i``.

    Attributes:
        ids: ``[N, K]`` int64 ids scored by the loss (top-k, or TCAD's support); padding: id 0. ``K = 0``
            with the hidden signal.
        logprobs: ``[N, K]`` float32 teacher log-probs at ``ids``; padding: ``-inf``.
        token_logprobs: ``[N]`` float32 teacher log-prob of each response token.
        hidden: ``[N, h_t]`` float32 teacher final hidden states (``teacher.signal=hidden``), or None.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    token_logprobs: torch.Tensor
    hidden: torch.Tensor | None = None

    def split(self, lengths: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per sample ``(ids, logprobs, hidden or None)``."""
        lengths = list(lengths)
        hidden = self.hidden.split(lengths) if self.hidden is not None else [None] * len(lengths)
        return list(zip(self.ids.split(lengths), self.logprobs.split(lengths), hidden))

    def padding(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows of this shape for a sample the teacher does not score: no support, no hidden state."""
        hidden = None if self.hidden is None else torch.zeros(length, self.hidden.shape[1])
        return (torch.zeros(length, self.ids.shape[1], dtype=torch.int64),
                torch.full((length, self.ids.shape[1]), float("-inf")), hidden)


@dataclasses.dataclass(frozen=True, slots=True)
class TeacherShare:
    """One teacher's part of a list of samples, as :func:`build_microbatch` places it.

    Attributes:
        name: the teacher.
        rows: per sample ``(ids [R_i, K], logprobs [R_i, K], hidden [R_i, h] or None)`` (padding where the
            teacher does not score the sample).
        coefficients: per sample ``[R_i]`` the token's coefficient in this teacher's divergence (0 where the
            teacher does not score the sample).
    """

    name: str
    rows: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    coefficients: Sequence[torch.Tensor]

    def take(self, indices: Sequence[int]) -> "TeacherShare":
        return TeacherShare(self.name, [self.rows[i] for i in indices], [self.coefficients[i] for i in indices])


@dataclasses.dataclass(frozen=True, slots=True)
class TCADSpec:
    """TCAD's support: ``support_k`` ids interleaved (or the union) from teacher and student top-k."""

    support_k: int
    mode: str = "interleave"

    @property
    def width(self) -> int:
        return self.support_k


def sanitize_student_topk(topk: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Student top-k ids the teacher can score: ``(ids to request, valid mask)``.

    Padding (-1) and ids past the real vocabulary (padded embedding rows) are not tokens: they are sent
    as id 0 (the teacher rejects ids outside its vocabulary) and marked invalid, so TCAD's support skips them.
    """
    valid = (topk >= 0) & (topk < vocab_size)
    return torch.where(valid, topk, torch.zeros_like(topk)), valid


def score_batch(samples: Sequence[Sample], *, top_k: int, temperature: float, vocab_size: int,
                request_student_topk: bool, signal: str = "topk", hidden_dtype: str = "bfloat16") -> ScoreBatch:
    """The teacher request for ``samples`` (with the student's top-k ids when TCAD needs them scored;
    ``signal="hidden"``: the teacher's final hidden states, in ``hidden_dtype`` on the wire)."""
    sequences = []
    for sample in samples:
        requested = None
        if request_student_topk:
            assert sample.student_topk is not None, "TCAD needs the rollout's student top-k ids"
            requested, _ = sanitize_student_topk(sample.student_topk, vocab_size)
            requested = requested.numpy()
        sequences.append(SequenceRequest(token_ids=sample.tokens.numpy(), response_start=sample.prompt_len,
                                         requested_ids=requested))
    return ScoreBatch(sequences=sequences, top_k=top_k, temperature=temperature, signal=signal,
                      hidden_dtype=hidden_dtype)


def _tcad_rows(output: TeacherOutput, student_topk: torch.Tensor, spec: TCADSpec, vocab_size: int):
    """The support ``U`` of one response and the teacher's log-probs there (from its top-k or the
    requested student ids; every id of ``U`` is one of the two)."""
    teacher_ids = torch.from_numpy(output.topk_ids)
    teacher_lp = torch.from_numpy(output.topk_logprobs)
    teacher_ids = torch.where(torch.isneginf(teacher_lp), torch.full_like(teacher_ids, -1), teacher_ids)
    student_ids, valid = sanitize_student_topk(student_topk, vocab_size)
    student_ids = torch.where(valid, student_ids, torch.full_like(student_ids, -1))
    support = tcad_support(teacher_ids, student_ids, None if spec.mode == "union" else spec.support_k, mode=spec.mode)
    candidates = torch.cat([teacher_ids, student_ids], dim=1)  # [R, Kt + Ks]
    candidate_lp = torch.cat([teacher_lp, torch.from_numpy(output.requested_logprobs)], dim=1)
    match = (support[:, :, None] == candidates[:, None, :]) & (support[:, :, None] >= 0)  # [R, k, Kt + Ks]
    logprobs = candidate_lp.gather(1, match.to(torch.uint8).argmax(-1))
    present = support >= 0
    return torch.where(present, support, torch.zeros_like(support)), torch.where(
        present, logprobs, torch.full_like(logprobs, float("-inf")))


def teacher_rows(outputs: Sequence[TeacherOutput], samples: Sequence[Sample], *, tcad: TCADSpec | None = None,
                 vocab_size: int | None = None) -> TeacherRows:
    """The rows the loss reads, concatenated over ``samples`` (TCAD: the support and its log-probs)."""
    ids, logprobs, tokens, hidden = [], [], [], []
    for output, sample in zip(outputs, samples, strict=True):
        if output.hidden is not None:
            hidden.append(torch.from_numpy(output.hidden))
        if tcad is None:
            ids.append(torch.from_numpy(output.topk_ids))
            logprobs.append(torch.from_numpy(output.topk_logprobs))
        else:
            support, support_lp = _tcad_rows(output, sample.student_topk, tcad, vocab_size)
            ids.append(support)
            logprobs.append(support_lp)
        tokens.append(torch.from_numpy(output.token_logprobs))
    return TeacherRows(torch.cat(ids), torch.cat(logprobs).float(), torch.cat(tokens).float(),
                       torch.cat(hidden).float() if hidden else None)


def token_coefficients(samples: Sequence[Sample], *, total_tokens: int, num_groups: int,
                       teacher_token_logprobs: Sequence[torch.Tensor] | None = None,
                       confidence_alpha: float | None = None) -> list[torch.Tensor]:
    """Per response token, its coefficient in the step's loss (see the module docstring).

    Args:
        samples: this rank's samples (whole prompt groups).
        total_tokens: response tokens of the whole global batch (token mean).
        num_groups: prompt groups of the whole global batch (confidence weighting).
        teacher_token_logprobs: ``[R_i]`` per sample, for the confidence weights.
        confidence_alpha: TCAD's sharpness, or ``None`` for the token mean.
    """
    if confidence_alpha is None:
        return [torch.full((s.response_len,), 1.0 / total_tokens, dtype=torch.float64) for s in samples]
    assert teacher_token_logprobs is not None, "confidence weights need the teacher's token log-probs"
    lengths = [s.response_len for s in samples]
    width = max(lengths)
    padded = torch.zeros(len(samples), width, dtype=torch.float64)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, values in enumerate(teacher_token_logprobs):
        padded[i, : lengths[i]] = values.double()
        mask[i, : lengths[i]] = True
    groups = torch.tensor([s.group for s in samples])
    weights = tcad_sequence_weights(padded, mask, groups, confidence_alpha).double()
    return [torch.full((length,), float(w) / (length * num_groups), dtype=torch.float64)
            for w, length in zip(weights, lengths)]


@dataclasses.dataclass(slots=True)
class TeacherSlice:
    """One teacher's tensors in a micro-batch: ``ids``/``logprobs`` ``[b, s, K]``, ``hidden`` ``[b, s, h]`` (the
    hidden signal) and the tokens' ``coefficients`` ``[b, s]`` in its divergence."""

    name: str
    coefficients: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    hidden: torch.Tensor | None = None

    def to(self, device: torch.device) -> "TeacherSlice":
        return TeacherSlice(self.name, *(None if t is None else t.to(device)
                                         for t in (self.coefficients, self.ids, self.logprobs, self.hidden)))



@dataclasses.dataclass(frozen=True, slots=True)
class PolicyShare:
    """The policy-gradient term's inputs of a list of samples, as :func:`build_microbatch` places them.

    Attributes:
        advantages: per sample, its reward advantage (every token of it carries it).
        coefficients: per sample ``[R_i]`` the token's coefficient in the policy-gradient loss (its aggregation).
        teacher_logprobs: per sample ``[R_i]`` the teacher's log-prob of each response token, or None where the
            combination does not read it.
        teacher_baseline: per sample ``[R_i]`` the baseline subtracted from each token's ``k1`` (``rl.teacher_baseline``),
            or None.
        kd_coef: the teacher's weight in the advantage at this batch (``rl.kd_coef_at``).
    """

    advantages: Sequence[float]
    coefficients: Sequence[torch.Tensor]
    teacher_logprobs: Sequence[torch.Tensor] | None = None
    teacher_baseline: Sequence[torch.Tensor] | None = None
    kd_coef: float = 1.0

    def take(self, indices: Sequence[int]) -> "PolicyShare":
        teacher, baseline = (None if values is None else [values[i] for i in indices]
                             for values in (self.teacher_logprobs, self.teacher_baseline))
        return PolicyShare([self.advantages[i] for i in indices], [self.coefficients[i] for i in indices], teacher,
                           baseline, self.kd_coef)


@dataclasses.dataclass(slots=True)
class PolicySlice:
    """The policy-gradient term's tensors in a micro-batch, ``[b, s]`` at the positions that predict each response
    token: the reward ``advantages`` (float64), the tokens' ``coefficients`` (float64) and the teacher's
    ``teacher_logprobs`` (float32, or None), and ``old_logprobs``: the trainer's log-probs of the sampled tokens
    before the batch's first update, which the step records when it makes several (``rl.ppo_epochs``,
    ``rl.mini_batches``; None: one update, the ratio is 1), ``teacher_baseline`` (float32, or None: the baseline
    of each token's ``k1``, ``rl.teacher_baseline``) and ``kd_coef``, the teacher's weight in the advantage at this
    batch. The sampled tokens and the rollout engine's log-probs are the micro-batch's :class:`SampledSlice`."""

    advantages: torch.Tensor
    coefficients: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    teacher_baseline: torch.Tensor | None = None
    kd_coef: float = 1.0

    def to(self, device: torch.device) -> "PolicySlice":
        return PolicySlice(*(None if t is None else t.to(device) for t in (
            self.advantages, self.coefficients, self.teacher_logprobs, self.old_logprobs, self.teacher_baseline)),
            kd_coef=self.kd_coef)


def _policy_slice(share: PolicyShare, samples: Sequence[Sample], shape: tuple[int, int]) -> PolicySlice:
    """The policy-gradient inputs at the positions that predict each response token (0 elsewhere)."""
    b, width = shape
    advantages = torch.zeros(b, width, dtype=torch.float64)
    coefficients = torch.zeros(b, width, dtype=torch.float64)
    teacher, baseline = (None if values is None else torch.zeros(b, width, dtype=torch.float32)
                         for values in (share.teacher_logprobs, share.teacher_baseline))
    for i, sample in enumerate(samples):
        start, length = sample.prompt_len - 1, sample.response_len
        advantages[i, start : start + length] = float(share.advantages[i])
        coefficients[i, start : start + length] = share.coefficients[i]
        if teacher is not None:
            teacher[i, start : start + length] = share.teacher_logprobs[i]
        if baseline is not None:
            baseline[i, start : start + length] = share.teacher_baseline[i]
    return PolicySlice(advantages, coefficients, teacher, teacher_baseline=baseline, kd_coef=share.kd_coef)


@dataclasses.dataclass(slots=True)
class SampledSlice:
    """The sampled tokens of a micro-batch, ``[b, s]`` at the positions that predict them: what the policy gradient
    trains and what the rollout-engine check (:mod:`megatron_gkd.trainer.engine_check`) compares.

    Attributes:
        token_ids: the response tokens (0 elsewhere).
        logprobs: float32, the rollout engine's raw log-prob of each (0 elsewhere).
        student: True at tokens the rollout engine sampled (not a dataset's or the teacher's response).
        current: True at the ones it sampled with the weights this update starts from: the trainer's log-probs of
            those must be the engine's (up to arithmetic), anything more is an engine that serves other weights.
        checked: the step compares them even where no pass of the loss yields the log-probs for free.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    student: torch.Tensor
    current: torch.Tensor
    checked: bool = False

    def to(self, device: torch.device) -> "SampledSlice":
        return SampledSlice(self.token_ids.to(device), self.logprobs.to(device), self.student.to(device),
                            self.current.to(device), self.checked)


def _sampled_slice(samples: Sequence[Sample], shape: tuple[int, int], weight_version: int | None,
                   version: int | None, checked: bool) -> SampledSlice:
    """The sampled tokens at the positions that predict them; ``weight_version``: the one that sampled the batch
    (a partial rollout's samples record theirs per token), ``version``: the update's."""
    b, width = shape
    token_ids = torch.zeros(b, width, dtype=torch.int64)
    logprobs = torch.zeros(b, width, dtype=torch.float32)
    student = torch.zeros(b, width, dtype=torch.bool)
    current = torch.zeros(b, width, dtype=torch.bool)
    for i, sample in enumerate(samples):
        start, length = sample.prompt_len - 1, sample.response_len
        token_ids[i, start : start + length] = sample.tokens[sample.prompt_len:]
        assert sample.logprobs is not None, "a sampled response carries the rollout engine's log-probs"
        logprobs[i, start : start + length] = sample.logprobs
        if sample.source != "student":
            continue
        student[i, start : start + length] = True
        if version is None:
            continue
        if sample.versions is not None:
            current[i, start : start + length] = sample.versions == version
        elif weight_version == version:
            current[i, start : start + length] = True
    return SampledSlice(token_ids, logprobs, student, current, checked)


@dataclasses.dataclass(slots=True)
class MicroBatch:
    """One micro-batch in Megatron's ``[b, s]`` layout (``s``: the longest input, padded to a multiple).

    ``teachers`` (one :class:`TeacherSlice` per teacher) and ``labels`` are set only where the loss is computed
    (the last pipeline stage; labels in the ``sft`` mode).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    coefficients: torch.Tensor
    labels: torch.Tensor | None = None
    teachers: list[TeacherSlice] = dataclasses.field(default_factory=list)
    padding_mask: torch.Tensor | None = None
    """``[b, s]`` True at padding positions (past a sample's input): MoE routing statistics (the load-balancing
    loss, expert load) leave them out, so they do not depend on how far a layout pads."""
    policy: PolicySlice | None = None
    """The policy-gradient term's inputs (``rl.combine``; last stage only)."""
    sampled: SampledSlice | None = None
    """The sampled tokens and the rollout engine's log-probs (training batches; last stage only)."""
    sources: dict[str, torch.Tensor] | None = None
    """GKD's mixture (``sample_mix``): per source, ``[b, s]`` True at the loss positions of its samples (every source
    of the run, empty or not, so every micro-batch reports the same statistics)."""
    token_versions: torch.Tensor | None = None
    """Partial rollouts: ``[b, s]`` int64 the weight version that sampled the response token each loss position
    predicts (-1 elsewhere); the loss reads the staleness ``version - token_versions``."""
    version: int | None = None
    """The student's weight version at the update that trains this micro-batch (with ``token_versions``)."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                 for f in dataclasses.fields(self) if f.name not in ("teachers", "sources", "version", "sampled")}
        sources = None if self.sources is None else {name: where.to(device) for name, where in self.sources.items()}
        return MicroBatch(**moved, teachers=[teacher.to(device) for teacher in self.teachers], sources=sources,
                          version=self.version, sampled=None if self.sampled is None else self.sampled.to(device))


def common_shape(samples: Sequence[Sample], plan: Sequence[Sequence[int]], pad_multiple: int = 1) -> tuple[int, int]:
    """The ``(b, s)`` that holds every micro-batch of ``plan`` (what pipeline parallelism pads to)."""
    width = max(samples[i].input_len for indices in plan for i in indices)
    return max(len(indices) for indices in plan), -(-width // pad_multiple) * pad_multiple


def split_to_count(plan: list[list[int]], count: int) -> list[list[int]]:
    """``plan`` with its largest micro-batches halved (order kept) until it has ``count`` of them.

    Every rank of an expert-parallel group must run the same number of micro-batches (each one's token
    dispatch is a collective); halving keeps each within the token budget it was planned for.
    """
    plan = [list(indices) for indices in plan]
    assert count <= sum(map(len, plan)), f"{sum(map(len, plan))} samples cannot fill {count} micro-batches"
    while len(plan) < count:
        largest = max(range(len(plan)), key=lambda k: len(plan[k]))
        indices = plan[largest]
        plan[largest : largest + 1] = [indices[: len(indices) // 2], indices[len(indices) // 2 :]]
    return plan


def plan_microbatches(lengths: Sequence[int], *, micro_batch_size: int | None = None,
                      max_tokens: int | None = None) -> list[list[int]]:
    """Groups sample indices into micro-batches.

    Fixed size: consecutive ``micro_batch_size`` samples. Token budget (dynamic batching): samples
    sorted by length (longest first, ties in order) are packed while ``count x longest <= max_tokens``
    (the padded size of the micro-batch).

    Raises:
        ValueError: a sample alone exceeds ``max_tokens``.
    """
    if max_tokens is None:
        assert micro_batch_size, "give micro_batch_size or max_tokens"
        indices = list(range(len(lengths)))
        return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan: list[list[int]] = []
    for index in order:
        if lengths[index] > max_tokens:
            raise ValueError(f"a sample of {lengths[index]} tokens exceeds trainer.max_tokens_per_microbatch="
                             f"{max_tokens}; raise it (or lower the prompt/response limits)")
        if plan and (len(plan[-1]) + 1) * lengths[plan[-1][0]] <= max_tokens:
            plan[-1].append(index)
        else:
            plan.append([index])
    return plan


def build_microbatch(samples: Sequence[Sample], coefficients: Sequence[torch.Tensor], *, pad_multiple: int = 1,
                     rows: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, labels: bool = False,
                     pad_token_id: int = 0, shape: tuple[int, int] | None = None,
                     teachers: Sequence[TeacherShare] | None = None, policy: PolicyShare | None = None,
                     sources: Sequence[str] | None = None, version: int | None = None,
                     sampled: tuple[int | None, bool] | None = None) -> MicroBatch:
    """The ``[b, s]`` tensors of ``samples`` (right padding; positions past a sample carry no loss).

    Args:
        samples: the micro-batch's samples.
        coefficients: ``[R_i]`` loss coefficient per response token of each sample.
        pad_multiple: ``s`` is rounded up to a multiple (sequence parallelism needs a multiple of TP).
        rows: per sample ``(ids [R_i, K], logprobs [R_i, K], hidden [R_i, h_t] or None)`` rows of the one teacher
            (named ``teacher``, the token coefficients its divergence's), placed at the positions that predict
            each response token (``None`` on ranks without a loss).
        teachers: instead of ``rows``, every teacher's rows and coefficients (several teachers).
        labels: also build next-token labels (cross-entropy).
        shape: pad to this ``(b, s)`` (extra rows are all padding): pipeline stages exchange activations
            of one fixed shape per step.
        policy: the policy-gradient term's inputs of ``samples`` (``rl.combine``; ranks with a loss).
        sources: the run's sample sources (``sample_mix``): a loss mask per source (``MicroBatch.sources``).
        version: the weight version of the update that trains ``samples`` (``MicroBatch.version``); their tokens'
            own versions (``Sample.versions``) are placed where the samples carry them.
        sampled: ``(the weight version that sampled them, whether the engine check is due)``: the sampled tokens
            (``MicroBatch.sampled``; training batches on ranks with a loss).
    """
    width = max(s.input_len for s in samples)
    width = -(-width // pad_multiple) * pad_multiple
    b = len(samples)
    if shape is not None:
        assert shape[0] >= b and shape[1] >= width, f"shape {shape} cannot hold {b} samples of {width} tokens"
        b, width = shape
    tokens = torch.full((b, width), pad_token_id, dtype=torch.int64)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    weights = torch.zeros(b, width, dtype=torch.float64)
    label_ids = torch.full((b, width), pad_token_id, dtype=torch.int64) if labels else None
    versioned = version is not None and any(sample.versions is not None for sample in samples)
    assert policy is None or sampled is not None, "the policy gradient reads the sampled tokens (sampled=...)"
    sampled_slice = None if sampled is None else _sampled_slice(samples, (b, width), sampled[0], version, sampled[1])
    token_versions = torch.full((b, width), -1, dtype=torch.int64) if versioned else None
    for i, (sample, coefficient) in enumerate(zip(samples, coefficients, strict=True)):  # rows past them: padding
        start, length = sample.prompt_len - 1, sample.response_len
        tokens[i, : sample.input_len] = sample.tokens[:-1]
        loss_mask[i, start : start + length] = True
        weights[i, start : start + length] = coefficient
        if token_versions is not None:
            token_versions[i, start : start + length] = sample.versions if sample.versions is not None else version
        if label_ids is not None:
            label_ids[i, : sample.input_len] = sample.tokens[1:]
    if rows:
        teachers = [TeacherShare("teacher", rows, coefficients)]
    slices = [_teacher_slice(share, samples, (b, width)) for share in teachers or []]
    position_ids = torch.arange(width, dtype=torch.int64).unsqueeze(0).expand(b, width).contiguous()
    lengths = torch.tensor([s.input_len for s in samples] + [0] * (b - len(samples)))
    padding_mask = position_ids >= lengths[:, None]
    masks = None
    if sources is not None:
        rows = [s.source for s in samples] + [None] * (b - len(samples))
        masks = {name: loss_mask & torch.tensor([row == name for row in rows])[:, None] for name in sources}
    return MicroBatch(tokens=tokens, position_ids=position_ids, loss_mask=loss_mask, coefficients=weights,
                      labels=label_ids, teachers=slices, padding_mask=padding_mask,
                      policy=None if policy is None else _policy_slice(policy, samples, (b, width)), sources=masks,
                      token_versions=token_versions, version=version if versioned else None, sampled=sampled_slice)


def _teacher_slice(share: TeacherShare, samples: Sequence[Sample], shape: tuple[int, int]) -> TeacherSlice:
    """One teacher's rows and coefficients at the positions that predict each response token."""
    b, width = shape
    num_ids = share.rows[0][0].shape[1]
    hidden_size = share.rows[0][2].shape[1] if share.rows[0][2] is not None else None
    ids = torch.zeros(b, width, num_ids, dtype=torch.int64)
    logprobs = torch.full((b, width, num_ids), float("-inf"), dtype=torch.float32)
    hidden = torch.zeros(b, width, hidden_size, dtype=torch.float32) if hidden_size else None
    coefficients = torch.zeros(b, width, dtype=torch.float64)
    for i, sample in enumerate(samples):
        start, length = sample.prompt_len - 1, sample.response_len
        sample_ids, sample_logprobs, sample_hidden = share.rows[i]
        ids[i, start : start + length] = sample_ids
        logprobs[i, start : start + length] = sample_logprobs
        coefficients[i, start : start + length] = share.coefficients[i]
        if hidden is not None:
            hidden[i, start : start + length] = sample_hidden
    return TeacherSlice(share.name, coefficients, ids, logprobs, hidden)


def samples_from_rollout(batch, indices: Sequence[int], prompt_indices: Sequence[int],
                         prompt_groups: Sequence[str | None] | None = None,
                         prompt_sources: Sequence[str] | None = None) -> list[Sample]:
    """:class:`Sample` objects for rows ``indices`` of a :class:`~megatron_gkd.rollout.RolloutBatch`.

    ``prompt_indices[g]`` / ``prompt_groups[g]`` / ``prompt_sources[g]``: the dataset row of prompt group ``g``, its
    record's group and where its responses come from (default: the student).
    """
    samples = []
    for i in indices:
        prompt, response = batch.prompt(i), batch.response(i)
        group = int(batch.group_ids[i])
        samples.append(Sample(tokens=torch.tensor(prompt + response, dtype=torch.int64), prompt_len=len(prompt),
                              group=group, prompt_index=int(prompt_indices[group]), student_topk=batch.topk(i),
                              data_group=prompt_groups[group] if prompt_groups is not None else None,
                              logprobs=batch.logprobs(i).float(),
                              source=prompt_sources[group] if prompt_sources is not None else "student",
                              versions=None if batch.token_versions is None else batch.versions(i)))
    return samples


def share_rows(batch, num_prompts: int, num_shares: int, share: int) -> list[int]:
    """The rows of ``batch`` (a rollout batch of ``num_prompts`` prompt groups) in data-parallel share ``share`` of
    ``num_shares``: a contiguous block of whole prompt groups."""
    groups = np.array_split(np.arange(num_prompts), num_shares)
    mine = set(groups[share].tolist())
    return [i for i in range(batch.num_samples) if int(batch.group_ids[i]) in mine]


def rank_samples(batch, state, prompt_indices: Sequence[int], prompt_groups: Sequence | None = None,
                 prompt_sources: Sequence[str] | None = None) -> list[Sample]:
    """This data-parallel rank's samples of ``batch`` (``state``: the parallel state): a contiguous block of whole
    prompt groups (:func:`share_rows`, :func:`samples_from_rollout`)."""
    rows = share_rows(batch, len(prompt_indices), state.data_parallel_size, state.dp_rank)
    return samples_from_rollout(batch, rows, prompt_indices, prompt_groups, prompt_sources)
