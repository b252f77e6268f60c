"""The last pipeline stage's output layer, swapped for the length of a forward: the student's loss keeps its logits or
its input (``megatron_gkd.trainer.logit_capture``), the teacher's scorer its input
(``megatron_gkd.teacher.backends.megatron_scoring``), so that ``GPTModel`` never builds the ``[s, b, V/tp]`` logits of every
position where only some rows are read.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

from megatron_gkd.models.builder import unwrap


@contextlib.contextmanager
def patch_output_layer(model, captured: types.SimpleNamespace, make_forward) -> Iterator[types.SimpleNamespace]:
    """Replaces the last stage's output-layer ``forward`` by ``make_forward(layer)`` for the block
    (nothing on other stages) and yields ``captured``."""
    gpt = unwrap(model)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    if layer is None:
        yield captured
        return
    layer.forward = make_forward(layer)
    try:
        yield captured
    finally:
        del layer.forward


def capture_output_layer(model, tp_group):
    """Makes the last stage's ``GPTModel`` return its final hidden states ``[b, s, h]`` instead of
    logits; ``captured.weight`` is then the output-layer weight (the shared embedding when tied).

    With sequence parallelism the hidden states are gathered along the sequence (backward:
    reduce-scatter), as the column-parallel output layer would.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    captured = types.SimpleNamespace(weight=None, sequence_parallel=False)

    def make_forward(layer):
        captured.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))

        def forward(hidden, weight=None, runtime_gather_output=None):
            captured.weight = layer.weight if weight is None else weight
            if captured.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, group=tp_group)
            return hidden, None

        return forward

    return patch_output_layer(model, captured, make_forward)
