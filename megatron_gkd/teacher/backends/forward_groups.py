"""How a backend in this process cuts a batch into forward passes: consecutive rows, right-padded to the longest of
their pass, as many as fit a token budget (the ``hf`` backend's passes, the Megatron scorer's micro-batches)."""

from __future__ import annotations

from typing import Iterator, Sequence


def padded_length(length: int, multiple: int = 1) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (sequence parallelism splits a sequence over TP)."""
    return -(-length // multiple) * multiple


def forward_groups(lengths: Sequence[int], max_tokens: int, multiple: int = 1) -> Iterator[list[int]]:
    """Consecutive indices of ``lengths`` whose padded pass (count x longest, each length rounded up to ``multiple``)
    stays within ``max_tokens``; a row longer than that is a pass of its own."""
    group, longest = [], 0
    for index, length in enumerate(lengths):
        length = padded_length(length, multiple)
        if group and max(longest, length) * (len(group) + 1) > max_tokens:
            yield group
            group, longest = [], 0
        group.append(index)
        longest = max(longest, length)
    if group:
        yield group
