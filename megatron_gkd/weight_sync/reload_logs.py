"""vLLM's in-place reload without the log lines a user must learn to ignore, and with every real failure.

Each reload makes vLLM 0.32 log, per rank:

- ``INFO Reloading and processing weights took 0.07 seconds`` (and ``Reloading weights inplace...``): the
  time is the trainer's ``time/weight_sync`` metric already. Kept at DEBUG (the logger's level follows
  ours: shown when the run logs at DEBUG).
- ``WARNING RotaryEmbedding: Failed to load weights``: the rotary cos/sin cache is a buffer vLLM counts as
  loadable but no checkpoint holds; vLLM puts the old (computed, never trained) cache back. Always harmless.
- ``WARNING VocabParallelEmbedding: Failed to load weights`` (and ``ParallelLMHead``) on a TP rank whose
  vocabulary shard holds only padding rows (a tiny vocabulary padded to 64 and split over 2 ranks): nothing
  was due there, and the old, unused rows stay.

Only those two warnings are dropped, and only for a layer class whose every instance on this rank is such a
layer: a linear layer, or an embedding holding real rows, that gets no weights is still reported (the test
``tests/e2e/rollout/test_rollout_vllm.py`` reloads one tensor of many and checks that the rest are named).
"""

from __future__ import annotations

import logging

FAILED_TO_LOAD = "%s: Failed to load weights"  # vllm/model_executor/model_loader/reload/layerwise.py
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class HarmlessReloadWarnings(logging.Filter):
    """Drops vLLM's ``<layer>: Failed to load weights`` for the layer classes in ``harmless``; passes the rest.

    Args:
        harmless: class names of layers that hold nothing a checkpoint could load on this rank.
    """

    def __init__(self, harmless: set[str]):
        super().__init__()
        self.harmless = set(harmless)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != FAILED_TO_LOAD or not isinstance(record.args, tuple) or len(record.args) != 1:
            return True
        return record.args[0] not in self.harmless


def harmless_layers(model) -> set[str]:
    """Class names of ``model``'s layers for which vLLM's "Failed to load weights" says nothing: rotary
    embeddings, and vocabulary-parallel embeddings whose shard on this rank holds only padding rows. A class
    with one instance that is neither (e.g. a second embedding with real rows) is left out."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    verdicts: dict[str, bool] = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase):
            harmless = True
        elif isinstance(module, VocabParallelEmbedding):
            shard = module.shard_indices
            harmless = shard.num_org_elements == 0 and shard.num_added_elements == 0
        else:
            harmless = False
        name = type(module).__name__
        verdicts[name] = verdicts.get(name, True) and harmless
    return {name for name, harmless in verdicts.items() if harmless}


def quiet_reload_logs(model) -> None:
    """Before reloading ``model``: the filter above on vLLM's reload logger (installed once per process, set to
    the layers of the model about to reload), and vLLM's per-reload timing line shown only when this process
    logs at DEBUG."""
    layerwise = logging.getLogger(LAYERWISE_LOGGER)
    existing = next((f for f in layerwise.filters if isinstance(f, HarmlessReloadWarnings)), None)
    names = harmless_layers(model)
    if existing is None:
        layerwise.addFilter(HarmlessReloadWarnings(names))
    else:
        existing.harmless = names
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger(INPLACE_LOGGER).setLevel(logging.WARNING)
