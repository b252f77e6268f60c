"""Pruning, the Minitron way: a student HF checkpoint cut from a teacher HF checkpoint (issue #45, item 4).

The teacher is loaded as Megatron-Core shards under the run's parallel layout and scored on calibration text
(:mod:`~megatron_gkd.prune.importance`: each rank scores what it holds); the most important layers and channels are
kept (:mod:`~megatron_gkd.prune.selection`) and the exporter's gathered HF tensors are cut to them and written
(:mod:`~megatron_gkd.prune.apply`), with the teacher's tokenizer and chat template. The result is a smaller model of
the same architecture that transformers, vLLM and :func:`megatron_gkd.models.load_hf` load: a student to distil.

Command line (``python -m megatron_gkd.prune --help``)::

    python -m megatron_gkd.prune --teacher TEACHER --out STUDENT --num-layers 10
    torchrun --nproc_per_node 2 -m megatron_gkd.prune --teacher TEACHER --out STUDENT \\
        --hidden-size 0.75 --ffn-hidden-size 0.5 --num-attention-heads 6 --tensor-model-parallel-size 2

Library::

    tokens = calibration_tokens(teacher, path="prompts.jsonl", num_samples=64, seq_length=512)
    result = prune_checkpoint(teacher, out, PruneTargets(num_layers=10), tokens, state=state)
"""

from megatron_gkd.prune.apply import TensorPruner, pruned_tensors
from megatron_gkd.prune.calibration import calibration_tokens, pack
from megatron_gkd.prune.importance import DEPTH_METRICS, Importance, measure_importance
from megatron_gkd.prune.run import REPORT_FILE, PruneResult, prune_checkpoint
from megatron_gkd.prune.selection import KeptIndices, select_kept
from megatron_gkd.prune.targets import ModelSizes, PruneTargets, parameter_count, parse_size, pruned_hf_config

__all__ = [
    "DEPTH_METRICS",
    "REPORT_FILE",
    "Importance",
    "KeptIndices",
    "ModelSizes",
    "PruneResult",
    "PruneTargets",
    "TensorPruner",
    "calibration_tokens",
    "measure_importance",
    "pack",
    "parameter_count",
    "parse_size",
    "prune_checkpoint",
    "pruned_hf_config",
    "pruned_tensors",
    "select_kept",
]
