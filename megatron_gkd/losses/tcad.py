"""TCAD helpers: the support-symmetric truncation of the teacher and student top-k, and the
confidence weights of the responses of one prompt group.

The vocab-parallel top-k of the student lives in :mod:`.vocab_parallel` (:func:`vocab_parallel_topk`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

SUPPORT_MODES = ("interleave", "union")
PAD_ID = -1


def _interleave(teacher_ids: torch.Tensor, student_ids: torch.Tensor) -> torch.Tensor:
    """``[N, Kt + Ks]`` ids ordered teacher 1, student 1, teacher 2, ...; the longer list's tail last."""
    common = min(teacher_ids.shape[1], student_ids.shape[1])
    paired = torch.stack([teacher_ids[:, :common], student_ids[:, :common]], dim=2).flatten(1)
    return torch.cat([paired, teacher_ids[:, common:], student_ids[:, common:]], dim=1)


def _first_occurrences(candidates: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` bool: the entry is a non-negative id not seen earlier in its row.

    A stable sort keeps equal ids in their original order, so the first of each run of equal sorted
    ids is the earliest occurrence; no per-token Python loop and no ``[N, C, C]`` comparison.
    """
    sorted_ids, order = candidates.sort(dim=1, stable=True)
    new_run = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_run[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    keep_sorted = new_run & (sorted_ids >= 0)
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def tcad_support(
    teacher_topk_ids: torch.Tensor,
    student_topk_ids: torch.Tensor,
    k: int | None,
    *,
    mode: str = "interleave",
) -> torch.Tensor:
    """The support ``U`` on which TCAD compares teacher and student.

    ``interleave`` (support-symmetric truncation): teacher rank 1, student rank 1, teacher rank 2, ...,
    skipping ids already taken, truncated to exactly ``k`` ids. ``union``: every distinct id of both
    lists in that same order, padded to ``Kt + Ks`` columns (``k`` is not used).

    Negative ids in the inputs are padding and are skipped; the output is padded with ``-1`` when a row
    has fewer distinct ids than its width. Score the teacher at ``U`` and pass ``-inf`` log-probs at the
    padding entries to :func:`vocab_parallel_distill_loss` with ``loss_type="tcad"``.

    Args:
        teacher_topk_ids: ``[..., Kt]`` int64, best first.
        student_topk_ids: ``[..., Ks]`` int64, best first (e.g. from rollout or
            :func:`vocab_parallel_topk`).
        k: width of the interleaved support (``mode="interleave"``).
        mode: ``interleave`` or ``union``.

    Returns:
        ``[..., k]`` (interleave) or ``[..., Kt + Ks]`` (union) int64 ids.

    Raises:
        ValueError: unknown mode, shapes disagree, or ``k`` missing / out of range for ``interleave``.
    """
    if mode not in SUPPORT_MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(SUPPORT_MODES)}")
    if teacher_topk_ids.shape[:-1] != student_topk_ids.shape[:-1]:
        raise ValueError(
            f"teacher_topk_ids {tuple(teacher_topk_ids.shape)} and student_topk_ids "
            f"{tuple(student_topk_ids.shape)} must agree in every dimension but the last"
        )
    lead = teacher_topk_ids.shape[:-1]
    width = teacher_topk_ids.shape[-1] + student_topk_ids.shape[-1]
    if mode == "union":
        if k is not None:
            logger.warning("tcad_support: k=%s has no effect with mode='union' (width is Kt + Ks)", k)
        k = width
    elif k is None or not 0 < k <= width:
        raise ValueError(f"k={k} must lie in [1, Kt + Ks = {width}] for mode='interleave'")
    candidates = _interleave(
        teacher_topk_ids.reshape(-1, teacher_topk_ids.shape[-1]).long(),
        student_topk_ids.reshape(-1, student_topk_ids.shape[-1]).long(),
    )
    keep = _first_occurrences(candidates)
    # Kept positions first, in their original order; then the rest (which become padding).
    position = torch.arange(width, device=candidates.device).expand_as(candidates)
    order = torch.where(keep, position, position + width).argsort(dim=1)[:, :k]
    support = candidates.gather(1, order)
    support = torch.where(keep.gather(1, order), support, torch.full_like(support, PAD_ID))
    return support.reshape(*lead, k)


def _as_list(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    if isinstance(value, torch.Tensor):
        return [value], False
    return list(value), True


def tcad_sequence_weights(
    teacher_token_logprobs: torch.Tensor | Sequence[torch.Tensor],
    response_mask: torch.Tensor | Sequence[torch.Tensor],
    group_ids: torch.Tensor | Sequence[torch.Tensor],
    alpha: float,
) -> torch.Tensor | list[torch.Tensor]:
    """Teacher-confidence weights of responses within their prompt groups (detached).

    ``c_i`` is the length-normalised teacher log-likelihood of response ``i`` (mean of the teacher's
    log-prob of each response token under the mask); ``w_i = softmax_{j in g(i)}(alpha (c_j - mean_g c))``
    over the responses ``j`` that share ``i``'s group id. Weights of a group sum to 1; the trainer's
    ``token_coefficients`` turns them into ``sum_i w_i mean_t loss_it``. Responses may come in any order and
    groups may span micro-batches: pass the micro-batches as lists and get a list of weights back, one
    ``[b_m]`` tensor per micro-batch. Responses without a masked-in token get weight 0 and take no part
    in their group's softmax.

    Args:
        teacher_token_logprobs: ``[B, T]`` teacher log-prob of each response token (or a list of
            ``[b_m, T_m]``, one per micro-batch).
        response_mask: same shape(s), true for response tokens that count.
        group_ids: ``[B]`` integer prompt-group id of each response (or a list of ``[b_m]``).
        alpha: sharpness; 0 gives uniform weights within each group.

    Returns:
        ``[B]`` weights (or a list matching the micro-batches).

    Raises:
        ValueError: the inputs disagree in structure or shape.
    """
    logprobs, is_list = _as_list(teacher_token_logprobs)
    masks, _ = _as_list(response_mask)
    groups, _ = _as_list(group_ids)
    if not (len(logprobs) == len(masks) == len(groups)):
        raise ValueError("teacher_token_logprobs, response_mask and group_ids need the same micro-batches")
    confidences, sizes = [], []
    for index, (lp, mask, group) in enumerate(zip(logprobs, masks, groups)):
        if lp.shape != mask.shape or lp.dim() != 2 or group.shape != lp.shape[:1]:
            raise ValueError(
                f"micro-batch {index}: teacher_token_logprobs {tuple(lp.shape)} and response_mask "
                f"{tuple(mask.shape)} must be [b, T] and group_ids {tuple(group.shape)} must be [b]"
            )
        mask = mask.bool()
        lp = lp.detach().double()
        total = torch.where(mask, lp, torch.zeros_like(lp)).sum(1)
        confidences.append(total / mask.sum(1).clamp(min=1))
        sizes.append(lp.shape[0])
    confidence = torch.cat(confidences)
    has_tokens = torch.cat([mask.bool().any(1) for mask in masks])
    _, group = torch.unique(torch.cat(groups), return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    device = confidence.device

    def per_group_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=torch.float64, device=device).index_add_(0, group, values)

    members = per_group_sum(has_tokens.double())
    group_mean = per_group_sum(torch.where(has_tokens, confidence, torch.zeros_like(confidence))) / members.clamp(min=1)
    score = alpha * (confidence - group_mean[group])
    score = torch.where(has_tokens, score, torch.full_like(score, float("-inf")))
    group_max = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=device)
    group_max = group_max.scatter_reduce(0, group, score, reduce="amax")
    exp = torch.where(has_tokens, (score - group_max[group]).exp(), torch.zeros_like(score))
    denominator = per_group_sum(exp)
    weights = (exp / denominator.clamp(min=1e-300)[group]).to(torch.float32)
    pieces = list(weights.split(sizes))
    return pieces if is_list else pieces[0]
