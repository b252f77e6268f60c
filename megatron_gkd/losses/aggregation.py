"""Reduction of per-token losses to the scalar that is back-propagated."""

from __future__ import annotations

import torch


def aggregate_distill_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    sequence_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduces a ``[B, T]`` per-token loss (sequence-major) to a scalar.

    * Without ``sequence_weights``: the token mean ``sum(mask * loss) / sum(mask)``.
    * With ``sequence_weights`` ``[B]`` (e.g. from :func:`tcad_sequence_weights`): the weighted sum of
      per-sequence means, ``sum_i w_i * mean_{t: mask_it} loss_it``. It adds up over micro-batches: the
      sum over micro-batches of this value, each with its slice of the weights, is the value for the
      whole batch. Sequences without a masked-in token contribute 0.

    Masked positions never propagate NaN/inf: their loss is replaced, not multiplied, by 0.
    Megatron's ``[s, b]`` layout must be transposed to ``[b, s]`` first.

    Args:
        per_token_loss: ``[B, T]`` losses.
        loss_mask: ``[B, T]`` bool or 0/1 mask of the tokens that count.
        sequence_weights: optional ``[B]`` weights (treated as constants).

    Returns:
        A scalar tensor in the dtype of ``per_token_loss``.

    Raises:
        ValueError: shapes disagree.
    """
    if per_token_loss.shape != loss_mask.shape or per_token_loss.dim() != 2:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and loss_mask {tuple(loss_mask.shape)} must "
            "both be [B, T] (transpose Megatron's [s, b] first)"
        )
    mask = loss_mask.bool()
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    if sequence_weights is None:
        return masked.sum() / mask.sum().clamp(min=1).to(per_token_loss.dtype)
    if sequence_weights.shape != per_token_loss.shape[:1]:
        raise ValueError(
            f"sequence_weights {tuple(sequence_weights.shape)} must be [B] = [{per_token_loss.shape[0]}]"
        )
    lengths = mask.sum(dim=1).clamp(min=1).to(per_token_loss.dtype)
    sequence_means = masked.sum(dim=1) / lengths
    return (sequence_weights.detach().to(per_token_loss.dtype) * sequence_means).sum()
