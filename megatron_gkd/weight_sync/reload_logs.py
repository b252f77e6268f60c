"""vLLM's in-place reload, audited: a layer or weight the reload left out fails the load; the warnings that say
nothing are dropped; a head tied to the embedding is brought up to date.

vLLM 0.32 reports what a reload did not load only as warnings, per rank, and then carries on with the old tensors
put back. Two of them say nothing:

- ``WARNING RotaryEmbedding: Failed to load weights``: the rotary cos/sin cache is a buffer vLLM counts as loadable
  but no checkpoint holds; vLLM puts the old (computed, never trained) cache back. Always harmless.
- ``WARNING VocabParallelEmbedding: Failed to load weights`` (and ``ParallelLMHead``) on a TP rank whose vocabulary
  shard holds only padding rows (a tiny vocabulary padded to 64 and split over 2 ranks): nothing was due there.

A third is harmless only once repaired. With **tied embeddings** (SmolLM2, Qwen3-0.6B to 4B, Llama-3.2, Gemma: the
commonest student) ``ParallelLMHead.weight`` *is* the embedding's parameter, which the reload updates in place, but
the head itself receives nothing, so vLLM never reprocesses it: on the CPU its matmul keeps the oneDNN-packed copy of
the weights it was started with (``dispatch_cpu_unquantized_gemm``), and the engine samples from the old head for
the whole run (seen with SmolLM2: prompt log-probs 2.1e-3 off after one step, the run silently off-policy).
:func:`reprocess_tied_layers` reruns the head's processing after every reload.

Every other ``<layer>: Failed to load weights`` and vLLM's ``Following weights were not loaded from checkpoint`` (but
for the parameters vLLM derives from loaded ones, ``DERIVED_PARAMETERS``) mean the engine now mixes old and new
weights: :class:`ReloadAudit` collects them and the reload raises
:class:`~megatron_gkd.weight_sync.errors.WeightSyncError` naming them (a weight sync always sends every tensor).
vLLM's per-reload timing line (``Reloading and processing weights took ...``) is kept at DEBUG (the time is the
trainer's ``time/weight_sync`` metric already).
"""

from __future__ import annotations

import collections
import logging

FAILED_TO_LOAD = "%s: Failed to load weights"  # vllm/model_executor/model_loader/reload/layerwise.py
NOT_LOADED = "Following weights were not loaded from checkpoint: %s"  # vllm/model_executor/model_loader/reload/inplace.py
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
# Parameters vLLM makes from loaded ones in a layer's processing and lists beside them, which no checkpoint holds:
# multi-latent attention's absorbed up-projections (``MLAAttention.process_weights_after_loading``, from
# ``kv_b_proj`` at every load and reload).
DERIVED_PARAMETERS = ("W_UK_T", "W_UV")
INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class ReloadAudit(logging.Filter):
    """Drops vLLM's reload warnings and keeps what they say: the layer classes that got no weights (those in
    ``harmless`` excepted) and the weight names vLLM did not load. Other records pass.

    Args:
        harmless: class names of layers that hold nothing a checkpoint could load on this rank (or that
            :func:`reprocess_tied_layers` repairs).
    """

    def __init__(self, harmless: set[str]):
        super().__init__()
        self.reset(harmless)

    def reset(self, harmless: set[str]) -> None:
        """Forgets what an earlier reload left out; ``harmless`` for the next one."""
        self.harmless = set(harmless)
        self.layers_left_out: collections.Counter[str] = collections.Counter()
        self.weights_left_out: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        if record.msg == FAILED_TO_LOAD and len(args) == 1:
            if args[0] not in self.harmless:
                self.layers_left_out[str(args[0])] += 1
            return False
        if record.msg == NOT_LOADED and len(args) == 1:
            self.weights_left_out.update(str(name) for name in args[0]
                                         if str(name).rpartition(".")[2] not in DERIVED_PARAMETERS)
            return False
        return True

    def problems(self) -> str | None:
        """What the reload left out, in words, or None when it loaded everything."""
        if not self.layers_left_out and not self.weights_left_out:
            return None
        layers = ", ".join(f"{name} x{count}" for name, count in sorted(self.layers_left_out.items()))
        weights = sorted(self.weights_left_out)
        named = ", ".join(weights[:5]) + (f" and {len(weights) - 5} more" if len(weights) > 5 else "")
        return "; ".join(part for part in (f"layers that got no weights: {layers}" if layers else "",
                                           f"weights not loaded: {named}" if weights else "") if part)


def _is_padding_only(module) -> bool:
    shard = module.shard_indices
    return shard.num_org_elements == 0 and shard.num_added_elements == 0


def tied_layers(model) -> list:
    """``model``'s vocabulary layers that share their weight with an earlier one (a tied LM head), in order."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    owners: dict[int, object] = {}
    tied = []
    for module in model.modules():
        weight = getattr(module, "weight", None) if isinstance(module, VocabParallelEmbedding) else None
        if weight is None:
            continue
        if id(weight) in owners:
            tied.append(module)
        else:
            owners[id(weight)] = module
    return tied


def harmless_layers(model) -> set[str]:
    """Class names of ``model``'s layers for which vLLM's "Failed to load weights" says nothing: rotary embeddings,
    vocabulary-parallel embeddings whose shard on this rank holds only padding rows, and heads tied to the embedding
    (their weight is the embedding's; :func:`reprocess_tied_layers` redoes their processing). A class with one
    instance that is none of these (e.g. a second embedding with real rows) is left out."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tied = {id(module) for module in tied_layers(model)}
    verdicts: dict[str, bool] = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase):
            harmless = True
        elif isinstance(module, VocabParallelEmbedding):
            harmless = id(module) in tied or _is_padding_only(module)
        else:
            harmless = False
        name = type(module).__name__
        verdicts[name] = verdicts.get(name, True) and harmless
    return {name for name, harmless in verdicts.items() if harmless}


def reprocess_tied_layers(model) -> int:
    """Reruns the weight processing of every head tied to the embedding (see the module docstring); returns how many.

    The processing reads the weight the reload just updated in place; on accelerators it does nothing for an
    unquantized head, on the CPU it repacks the head's matmul weights.
    """
    layers = tied_layers(model)
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
    return len(layers)


def audit_reload(model) -> ReloadAudit:
    """Before reloading ``model``: the audit on vLLM's two reload loggers (installed once per process, reset for the
    layers of the model about to reload), and vLLM's per-reload timing line shown only when this process logs at
    DEBUG. Read :meth:`ReloadAudit.problems` after the reload."""
    loggers = [logging.getLogger(LAYERWISE_LOGGER), logging.getLogger(INPLACE_LOGGER)]
    audit = next((f for f in loggers[0].filters if isinstance(f, ReloadAudit)), None)
    if audit is None:
        audit = ReloadAudit(set())
    audit.reset(harmless_layers(model))
    for logger_ in loggers:
        if audit not in logger_.filters:
            logger_.addFilter(audit)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        loggers[1].setLevel(logging.WARNING)
    return audit
