"""One pruning run: the teacher loaded under the run's parallel layout, scored on calibration tokens, cut, written.

Every rank loads its shard of the teacher (:func:`megatron_gkd.models.load_hf`), scores what it holds
(:mod:`~megatron_gkd.prune.importance`), rank 0 selects what the student keeps from the reduced scores and sends the
selection to every rank, and the exporter gathers each HF tensor on its owner rank, where it is cut
(:mod:`~megatron_gkd.prune.apply`) and written (:func:`megatron_gkd.models.write_hf`): no rank holds more than its
shard and the tensors it writes. The output directory appears whole or not at all (``<out>.partial`` renamed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch

from megatron_gkd.models import commit_output, export_hf_weights, load_hf, partial_output, read_hf_config, write_hf
from megatron_gkd.models.hf_config import torch_dtype
from megatron_gkd.parallel.comm import broadcast_msgpack
from megatron_gkd.prune.apply import TensorPruner, pruned_tensors
from megatron_gkd.prune.importance import Importance, measure_importance
from megatron_gkd.prune.selection import KeptIndices, select_kept
from megatron_gkd.prune.targets import ModelSizes, PruneTargets, parameter_count, pruned_hf_config

logger = logging.getLogger(__name__)

REPORT_FILE = "pruning.json"


@dataclasses.dataclass(frozen=True)
class PruneResult:
    """What a run measured and kept (the same on every rank)."""

    teacher: ModelSizes
    student: ModelSizes
    kept: KeptIndices
    importance: Importance
    teacher_parameters: int
    student_parameters: int
    seconds: float

    def summary(self) -> dict:
        """The figures of the run, JSON-ready (``pruning.json`` adds the kept indices)."""
        return dict(teacher=dataclasses.asdict(self.teacher), student=dataclasses.asdict(self.student),
                    teacher_parameters=self.teacher_parameters, student_parameters=self.student_parameters,
                    depth_metric=self.importance.depth_metric, calibration_loss=self.importance.loss,
                    layer_importance=self.importance.layers.tolist(), kept_layers=self.kept.layers,
                    seconds=round(self.seconds, 1))


def prune_checkpoint(teacher_path: str, out: str, targets: PruneTargets, tokens: torch.Tensor, *, state,
                     depth_metric: str = "cosine", micro_batch_size: int = 1,
                     dtype: torch.dtype = torch.float32) -> PruneResult:
    """Writes the student pruned from the HF checkpoint ``teacher_path`` to ``out`` (collective over every rank).

    Args:
        teacher_path: the teacher's HF checkpoint directory (its tokenizer files are copied with the student).
        out: the student's directory; it must not exist.
        targets: what the student keeps.
        tokens: ``[n, s]`` calibration tokens, the same on every rank (:func:`~megatron_gkd.prune.calibration_tokens`).
        state: the :class:`~megatron_gkd.parallel.ParallelState` to load the teacher on.
        depth_metric: ``cosine`` or ``loss`` (:mod:`~megatron_gkd.prune.importance`).
        micro_batch_size: calibration sequences per forward.
        dtype: the dtype the teacher is scored in; the student is written in the teacher's checkpoint dtype.

    Raises:
        ValueError: the teacher cannot be pruned to ``targets`` (the message says why and what is valid).
        FileExistsError: ``out`` exists.
    """
    started = time.perf_counter()
    hf_config = read_hf_config(teacher_path)
    teacher = ModelSizes.of(hf_config)
    student = targets.resolve(teacher)
    if student.num_layers == teacher.num_layers and depth_metric != "cosine":
        logger.warning("depth_metric=%s has no effect: every layer is kept (scoring with cosine, one pass)", depth_metric)
        depth_metric = "cosine"
    if student.num_query_groups % state.tp_size:
        logger.warning("the student's %d query groups do not split across tensor_model_parallel_size=%d: load it with a "
                       "tensor-parallel size that divides %d", student.num_query_groups, state.tp_size,
                       student.num_query_groups)
    partial = partial_output(out)
    # Transformer Engine fuses the norms into the projections, where no hook can read their outputs.
    chunks = load_hf(teacher_path, dtype=dtype, state=state, use_transformer_engine=False)
    importance = measure_importance(chunks, tokens, state=state, sizes=teacher, depth_metric=depth_metric,
                                    micro_batch_size=micro_batch_size)
    # Rank 0 selects and sends its selection: every rank then cuts by the same indices, whatever the rounding.
    selected = select_kept(importance, teacher, student).to_dict() if state.rank == 0 else None
    kept = KeptIndices.from_dict(broadcast_msgpack(selected, src=0, group=state.control_group))
    config = pruned_hf_config(hf_config, student, kept.layers)
    write_hf(pruned_tensors(export_hf_weights(chunks), TensorPruner(kept, teacher)), partial, hf_config=config,
             dtype=torch_dtype(hf_config, default=dtype), tokenizer_source=teacher_path)
    result = PruneResult(teacher=teacher, student=student, kept=kept, importance=importance,
                         teacher_parameters=parameter_count(hf_config), student_parameters=parameter_count(config),
                         seconds=time.perf_counter() - started)
    if state.rank == 0:
        with open(os.path.join(partial, REPORT_FILE), "w") as handle:
            json.dump({"teacher_path": os.path.abspath(teacher_path), **result.summary(), "kept": kept.to_dict()}, handle)
    commit_output(partial, out)
    logger.info("pruned %s (%.1fM parameters) to %s (%.1fM) in %.0f s", teacher_path, result.teacher_parameters / 1e6,
                out, result.student_parameters / 1e6, result.seconds)
    return result
