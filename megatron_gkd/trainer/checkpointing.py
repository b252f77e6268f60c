"""Distributed checkpoints: Megatron ``dist_checkpointing``, written atomically, resumable on another layout.

What a checkpoint holds:

* the model (``chunk.sharded_state_dict()`` per virtual-pipeline chunk) and the optimizer state
  (``optimizer.sharded_state_dict(model_sharded_state_dict)``): sharded tensors keyed by global
  parameter names and offsets, so a checkpoint saved at TP=2 loads at TP=1, PP=2, ...;
* common state (written once by rank 0): the LR scheduler, the data position (``data_state``), the
  step and the saving layout;
* per-rank RNG states (Python, NumPy, torch host and accelerator generators, Megatron's model-parallel
  RNG tracker) as one ``ShardedObject`` per rank. They are restored only when the layout is unchanged
  (a rank of another layout has no counterpart to take them from); otherwise a warning says so.

Atomicity and the on-disk layout are :mod:`megatron_gkd.trainer.checkpoint_dirs`: every rank writes
into ``<root>/.tmp-iter_XXXXXXX-<nonce>``, rank 0 writes the completion marker last, renames the
directory to ``<root>/iter_XXXXXXX`` and replaces ``<root>/latest``.

Typical use (after :func:`megatron_gkd.parallel.initialize`)::

    save_checkpoint(root, step, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                    data_state=loader.state_dict(), parallel_state=state, keep_last_n=3)
    step, data_state = load_checkpoint(root, model_chunks=chunks, optimizer=optimizer,
                                       scheduler=scheduler, parallel_state=state)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import secrets
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.config import to_yaml
from megatron_gkd.models import save_hf
from megatron_gkd.parallel import ParallelState
from megatron_gkd.trainer import checkpoint_dirs, run_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_RNG_KEY = "rng_state"
# How Megatron lays out optimizer state. "fully_reshardable" keeps the distributed optimizer's state
# in the model's (TP/PP-sharded, DP-replicated) shapes, so it reshards across TP, PP and DP alike; the
# default of megatron-core 0.16.1 ("fully_sharded_model_space") is deprecated and fails to save there
# ("ShardedTensor.flattened_range is not supported"). Without prefixes per chained optimizer, a
# checkpoint does not depend on how the parameters were split into optimizer groups. A *fresh*
# distributed optimizer on a build without Apex/TE needs its torch Adam state allocated before loading
# (see _allocate_torch_adam_state).
_OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}


def _save_strategy(thread_count: int = 1):
    """Megatron's ``torch_dist`` format, written by this process (no helper processes).

    Megatron's own writer (``FileSystemWriterAsync``) returns its results through a
    ``multiprocessing.Manager()`` queue started with the *spawn* method and forks one writer process
    per file. Seen on megatron-core 0.16.1: in a daemonic rank process (the ranks of
    :func:`megatron_gkd.testing.distributed.run_distributed`) the Manager cannot start at all
    ("daemonic processes are not allowed to have children"), and under torchrun it re-imports the
    entry script, so an unguarded script hangs after ``common.pt`` (first seen on the development machine; re-seen here,
    and ``tests/distributed/trainer/test_checkpointing_torchrun.py`` shows such a script saving with
    this strategy). Torch's
    ``FileSystemWriter`` writes the same files (``__<rank>_<i>.distcp`` + ``.metadata``) from this
    process and fsyncs each one; Megatron's planner and its loader are used unchanged. The price is
    that the save is synchronous (no overlap with training), which Megatron's sync path is too.
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            writer = FileSystemWriter(
                checkpoint_dir, single_file_per_rank=True, sync_files=True, thread_count=self.thread_count
            )
            planner = MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            )
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)

        def async_save(self, sharded_state_dict, checkpoint_dir):
            raise NotImplementedError("the in-process torch_dist strategy saves synchronously only")

    return InProcessTorchDistSaveStrategy("torch_dist", 1, thread_count=thread_count)


def _layout(parallel_state: ParallelState) -> dict:
    return {**dataclasses.asdict(parallel_state.config), "world_size": parallel_state.world_size}


def _params_dtype(model_chunks) -> str:
    return str(_unwrap(model_chunks[0]).config.params_dtype).removeprefix("torch.")


def _check_same_precision(meta: dict, model_chunks, path: Path) -> None:
    """A checkpoint resumes in the precision it was saved in: the optimizer state of a bf16 run (float32
    main weights beside bf16 parameters) has no counterpart in a float32 run's, and the reverse; Megatron
    would fail on it with an error about parameter ids. Checkpoints from before the dtype was recorded pass."""
    saved, current = meta.get("params_dtype"), _params_dtype(model_chunks)
    if saved is not None and saved != current:
        raise ValueError(
            f"{path} was saved by a {saved} run (student.dtype={saved}) and this run trains in {current}: resume "
            f"with student.dtype={saved}, or start a new run in {current} from an HF export of it "
            "(student.checkpoint=<output_dir>/hf/step_N)"
        )


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    # The wrappers' (DDP, Float16Module) generic sharded_state_dict would prefix every name with
    # "module."; the model's own one is what load_state_dict of the model expects back.
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _model_keys(num_chunks: int) -> list[str]:
    # Megatron's own naming: "model", or "model0", "model1", ... per virtual-pipeline chunk. Only the
    # sharded keys inside matter for resharding, so a VPP checkpoint loads without VPP and back.
    return ["model"] if num_chunks == 1 else [f"model{index}" for index in range(num_chunks)]


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "accelerator": platform.accelerator_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    platform.set_accelerator_rng_state(state["accelerator"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(parallel_state: ParallelState, state: dict | None):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One object per rank (global shape = world size): every rank's generators differ (the tracker
    # seeds depend on the TP/PP/EP rank), so none of them is a replica of another.
    return ShardedObject(
        _RNG_KEY, state, (parallel_state.world_size,), (parallel_state.rank,), replica_id=0
    )


def _sharded_state_dict(model_chunks, optimizer, parallel_state, *, is_loading: bool, rng: bool,
                        extra_models: dict | None = None) -> dict:
    model_state = {
        key: _unwrap(chunk).sharded_state_dict()
        for key, chunk in zip(_model_keys(len(model_chunks)), model_chunks)
    }
    state = dict(model_state)
    for name, chunks in (extra_models or {}).items():
        # The prefix keeps their global tensor keys apart from the student's, which they would otherwise repeat.
        state[name] = {key: _unwrap(chunk).sharded_state_dict(prefix=f"{name}.")
                       for key, chunk in zip(_model_keys(len(chunks)), chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        )
    if rng:
        state[_RNG_KEY] = _rng_sharded_object(parallel_state, None if is_loading else _rng_state())
    return state


def _torch_adam_distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers in ``optimizer`` that step a torch Adam (no Apex/TE on this build)."""
    return [
        sub for sub in getattr(optimizer, "chained_optimizers", [optimizer])
        if hasattr(sub, "gbuf_ranges") and isinstance(getattr(sub, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))
    ]


def _allocate_torch_adam_state(optimizer) -> None:
    """Gives a fresh distributed optimizer's torch Adam the state a first step would create.

    Without Apex/TE, megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` reads the Adam
    ``step`` from the inner torch optimizer's per-parameter state and asserts there is exactly one
    value. A fresh optimizer has no state yet (torch Adam creates it in its first ``step()``) and the
    loading path calls ``state_dict()`` before anything is loaded, so it failed with a bare
    ``AssertionError``. Zeros and ``step = 0`` are what torch Adam itself creates (a 0-d float32 host
    tensor); the load overwrites every value.
    """
    for sub in _torch_adam_distributed_optimizers(optimizer):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                if not sub.optimizer.state[param]:
                    sub.optimizer.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer):
    """Works around two faults of megatron-core 0.16.1's distributed optimizer over torch Adam.

    1. ``load_parameter_state_from_fully_reshardable`` leaves the per-parameter ``step`` out of the
       tensors it hands to ``_set_main_param_and_optimizer_states``, which copies every key of the
       destination state and so fails with ``KeyError: 'step'``. The step itself arrives through the
       param groups (``load_state_dict`` sets it), so the wrapper passes the destination's own value.
    2. ``load_state_dict`` gives every parameter the *same* step tensor, which torch Adam increments
       in place once per parameter per step (wrong bias correction from the second step on): each
       parameter gets its own copy afterwards.
    """
    optimizers = _torch_adam_distributed_optimizers(optimizer)
    for sub in optimizers:
        def set_states(model_param, tensors, sub=sub, original=sub._set_main_param_and_optimizer_states):
            group_index, group_order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state[sub.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        sub._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for sub in optimizers:
            del sub._set_main_param_and_optimizer_states  # the class's method again
            for state in sub.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


def _broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _on_rank0(action, errors: tuple[type[Exception], ...] = (OSError,)):
    """``action()`` on rank 0, its result on every rank; an error raised there is raised everywhere
    (as the same type with rank 0's message), so no rank waits on one that failed."""
    result, failure = None, None
    if dist.get_rank() == 0:
        try:
            result = action()
        except errors as error:
            failure = error
    result, message = _broadcast((result, None if failure is None else (type(failure).__name__, str(failure))))
    if failure is not None:
        raise failure
    if message is not None:
        kind = next((error for error in errors if error.__name__ == message[0]), RuntimeError)
        raise kind(f"on rank 0: {message[1]}")
    return result


def _check_same_on_all_ranks(data_state: dict) -> None:
    # Common state is written by rank 0 alone; Megatron only logs a warning when ranks differ, which
    # would silently resume the other ranks at rank 0's position.
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, data_state)
    differing = [rank for rank, state in enumerate(states) if state != states[0]]
    if differing:
        raise ValueError(
            f"data_state differs between rank 0 ({states[0]!r}) and ranks {differing} "
            f"(rank {differing[0]}: {states[differing[0]]!r}); pass the global data position, "
            "identical on every rank (e.g. the number of samples consumed in total)"
        )


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    model_chunks: list[torch.nn.Module],
    optimizer,
    scheduler,
    rng: bool = True,
    data_state: dict,
    parallel_state: ParallelState,
    keep_last_n: int | None = None,
    content_hashes: bool = False,
    extra_models: dict[str, list[torch.nn.Module]] | None = None,
) -> Path:
    """Saves a checkpoint of ``step`` under the root ``directory`` (collective: every rank calls it).

    Args:
        directory: the checkpoint root; ``iter_XXXXXXX`` directories and ``latest`` live in it.
        step: the number of optimizer steps taken so far.
        model_chunks: this rank's model chunks (Megatron modules, DDP-wrapped or not).
        optimizer: the Megatron optimizer.
        scheduler: Megatron's ``OptimizerParamScheduler`` (anything with ``state_dict``), or ``None``.
        rng: also save this rank's RNG states.
        data_state: the data position (e.g. the sampler's ``state_dict()``); must be identical on all
            ranks (it is common state, written once).
        parallel_state: from :func:`megatron_gkd.parallel.initialize`.
        keep_last_n: after the save, delete all but the newest ``keep_last_n`` complete checkpoints
            (``None`` keeps all).
        content_hashes: record a blake3 hash of every file in the completion marker (rank 0 reads
            the whole checkpoint once more); resuming then checks them.
        extra_models: more model chunks by name, saved (and resharded on load) like the student's: a self
            teacher's EMA of the weights (:mod:`megatron_gkd.trainer.ema`).

    Before writing, rank 0 finishes or rolls back a commit a crash interrupted, and moves checkpoints
    newer than ``step`` (a branch this run abandoned by resuming from an older step) into
    ``<directory>/abandoned/``, logged.

    Returns:
        The checkpoint directory ``<directory>/iter_XXXXXXX``.

    Raises:
        ValueError: ``keep_last_n`` < 1, or ``data_state`` differs between ranks (nothing is written).
    """
    from megatron.core import dist_checkpointing

    if keep_last_n is not None and keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1 (or None to keep every checkpoint), got {keep_last_n}")
    _check_same_on_all_ranks(data_state)
    root = Path(directory)

    def make_temp_dir() -> str:
        root.mkdir(parents=True, exist_ok=True)
        checkpoint_dirs.prepare_save(root, step)
        temp_dir = root / checkpoint_dirs.temp_name(step, secrets.token_hex(4))
        temp_dir.mkdir()
        return str(temp_dir)

    temp_dir = Path(_on_rank0(make_temp_dir))

    state = _sharded_state_dict(model_chunks, optimizer, parallel_state, is_loading=False, rng=rng,
                                extra_models=extra_models)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["data_state"] = data_state
    state["checkpoint"] = {
        "step": step,
        "layout": _layout(parallel_state),
        "params_dtype": _params_dtype(model_chunks),
        "rng": rng,
        "format_version": FORMAT_VERSION,
        "extra_models": sorted(extra_models or {}),
    }
    # Ends with a barrier after rank 0 wrote metadata.json: every rank's files are on disk here.
    dist_checkpointing.save(state, str(temp_dir), sharded_strategy=_save_strategy())

    final = root / checkpoint_dirs.iter_name(step)

    def commit() -> None:
        checkpoint_dirs.commit(temp_dir, root, step, content_hashes=content_hashes)
        logger.info("saved checkpoint %s", final)
        if keep_last_n is not None:
            checkpoint_dirs.prune(root, keep_last_n, keep=final)

    _on_rank0(commit)
    return final


def load_checkpoint(
    root: str | os.PathLike,
    *,
    model_chunks: list[torch.nn.Module],
    optimizer,
    scheduler,
    parallel_state: ParallelState,
    step: int | None = None,
    verify_hashes: bool | None = None,
    retire_newer: bool = True,
    extra_models: dict[str, list[torch.nn.Module]] | None = None,
) -> tuple[int, dict] | None:
    """Loads the newest complete checkpoint under ``root`` into the current layout (collective).

    The saving layout may differ (TP/PP/VPP change): model and optimizer tensors are resharded by
    Megatron. RNG states are restored only when the layout is the same, otherwise a warning says so.
    Incomplete checkpoints are skipped with a warning naming the reason and the one used instead.

    Args:
        root: the checkpoint root given to :func:`save_checkpoint`.
        model_chunks, optimizer, scheduler, parallel_state: as for :func:`save_checkpoint`; they are
            loaded in place (``optimizer`` and ``scheduler`` may be ``None`` to load the model only).
        step: load exactly this step instead of the newest.
        verify_hashes: check the chosen checkpoint's files against the blake3 hashes of its marker
            (``None``: when it has them; ``True``: refuse one without them; ``False``: sizes only).
        retire_newer: after loading, move checkpoints newer than the loaded one into
            ``<root>/abandoned/`` and point ``latest`` at the loaded one: the run continues from here,
            so those belong to an abandoned branch (``False`` for read-only uses such as evaluation).
        extra_models: as for :func:`save_checkpoint`, loaded in place; each must be in the checkpoint.

    Checkpoint files are unpickled by torch's loader: ``root`` must be storage that only the job's
    owner can write (a warning names paths that other users can write).

    Returns:
        ``(step, data_state)``, or ``None`` when ``root`` holds no complete checkpoint.

    Raises:
        FileNotFoundError: ``step`` was given and that checkpoint is missing or incomplete.
        ValueError: the checkpoint lacks one of ``extra_models`` (e.g. saved before ``teacher.self_weights=ema``).
    """
    from megatron.core import dist_checkpointing

    found = _on_rank0(lambda: checkpoint_dirs.find_checkpoint(root, step, verify_hashes=verify_hashes),
                      errors=(FileNotFoundError, OSError))
    if found is None:
        logger.info("no complete checkpoint under %s; starting from scratch", root)
        return None

    common = dist_checkpointing.load_common_state_dict(str(found.path))
    meta = common["checkpoint"]
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{found.path} has checkpoint format {meta.get('format_version')}, this code reads "
            f"{FORMAT_VERSION}; convert it or load it with the version that wrote it"
        )
    _check_same_precision(meta, model_chunks, found.path)
    missing = sorted(set(extra_models or {}) - set(meta.get("extra_models", ())))
    if missing:
        raise ValueError(f"{found.path} holds no {', '.join(missing)} (it was saved by a run without them, e.g. without "
                         "teacher.self_weights=ema): resume with the run's own settings, or start a new run from an HF "
                         "export of it (student.checkpoint=<output_dir>/hf/step_N)")
    same_layout = meta["layout"] == _layout(parallel_state)
    has_rng = meta["rng"]
    restore_rng = same_layout and has_rng
    if not restore_rng and dist.get_rank() == 0:
        if has_rng:
            why = f"it was saved with layout {meta['layout']} and this run has {_layout(parallel_state)}"
        else:
            why = "it holds no RNG states"
        logger.warning(
            "RNG states of %s are not restored (%s): random draws after resuming differ from an "
            "uninterrupted run",
            found.path.name,
            why,
        )

    if optimizer is not None:
        _allocate_torch_adam_state(optimizer)
    state = _sharded_state_dict(model_chunks, optimizer, parallel_state, is_loading=True, rng=restore_rng,
                                extra_models=extra_models)
    loaded = dist_checkpointing.load(state, str(found.path))

    for chunk, key in zip(model_chunks, _model_keys(len(model_chunks))):
        _unwrap(chunk).load_state_dict(loaded[key], strict=True)
    for name, chunks in (extra_models or {}).items():
        for chunk, key in zip(chunks, _model_keys(len(chunks))):
            _unwrap(chunk).load_state_dict({k.removeprefix(f"{name}."): v for k, v in loaded[name][key].items()},
                                           strict=True)
    if optimizer is not None:
        with _torch_adam_step_kept(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        if common.get("scheduler") is None:
            raise ValueError(f"{found.path} holds no scheduler state; pass scheduler=None to skip it")
        scheduler.load_state_dict(common["scheduler"])
    if restore_rng:
        _set_rng_state(loaded[_RNG_KEY])
    if retire_newer:
        _on_rank0(lambda: _continue_from(found))
    if dist.get_rank() == 0:
        logger.info("resumed from %s (step %d)", found.path, meta["step"])
    return meta["step"], common["data_state"]


def _continue_from(found: checkpoint_dirs.Found) -> None:
    """The run continues from ``found``: newer checkpoints are an abandoned branch, ``latest`` names it."""
    root = found.path.parent
    checkpoint_dirs.retire_newer(root, found.step)
    if checkpoint_dirs.read_latest(root) != found.path.name:
        checkpoint_dirs.write_latest(root, found.path.name)



class RunCheckpoints:
    """The trainer's checkpoints, as the ``checkpoint`` section asks: resume, save (at intervals, at the end, on a
    signal, after a failed step), HF export. What a run's checkpoint holds besides the model, optimizer and
    schedule is assembled here and read back here: the sampler's position, the tokens trained, the config.

    Args:
        config: the run's :class:`~megatron_gkd.config.GKDConfig`.
        out: the run directory (checkpoints in ``out/checkpoints``, HF exports in ``out/hf/step_N``).
        student: the :class:`~megatron_gkd.trainer.components.Student`.
        parallel_state: the parallel state.
        timers: the trainer's phase timers (``checkpoint``, ``hf_export``).
        extra_models: more model chunks by name, saved and restored with the student (a self teacher's EMA).
    """

    def __init__(self, config, out: Path, student, parallel_state: ParallelState, timers, extra_models=None):
        self.config, self.student, self.state, self.timers = config, student, parallel_state, timers
        self.extra_models = extra_models or {}  # a self teacher's EMA by checkpoint key
        self.section = config.checkpoint
        self.out = Path(out)
        self.root = run_dir.checkpoints(self.out)

    def resume(self) -> tuple[int, dict, int] | None:
        """Loads the checkpoint ``checkpoint.resume`` names (``auto``: the run's newest, if any) in place; returns
        ``(step, sampler state, tokens trained)``, or None when the run starts fresh.

        Raises:
            FileNotFoundError: an explicit ``checkpoint.resume`` holds no complete checkpoint.
        """
        setting = self.section.resume
        root = None if setting == "never" else self.root if setting == "auto" else Path(setting)
        if root is None or (setting == "auto" and not root.exists()):
            return None
        loaded = load_checkpoint(root, model_chunks=self.student.chunks, optimizer=self.student.optimizer,
                                 scheduler=self.student.lr_scheduler, parallel_state=self.state,
                                 extra_models=self.extra_models)
        if loaded is None:
            if setting != "auto":
                raise FileNotFoundError(f"checkpoint.resume={setting}: no complete checkpoint there")
            return None
        step, data_state = loaded
        return step, data_state["sampler"], int(data_state.get("tokens_trained", 0))

    def save(self, step: int, sampler_state: dict, tokens_trained: int) -> None:
        """Saves step ``step`` (``sampler_state``: where the data resumes; collective)."""
        data_state = {"sampler": sampler_state, "tokens_trained": tokens_trained, "config": to_yaml(self.config)}
        with self.timers("checkpoint"):
            save_checkpoint(self.root, step, model_chunks=self.student.chunks, optimizer=self.student.optimizer,
                            scheduler=self.student.lr_scheduler, data_state=data_state, parallel_state=self.state,
                            keep_last_n=self.section.keep_last_n, content_hashes=self.section.content_hashes,
                            extra_models=self.extra_models)

    def save_after_failure(self, step: int, sampler_state: dict, tokens_trained: int) -> None:
        """After a failed step (e.g. the teacher down past its deadline): keeps the last complete step, if the run
        saves checkpoints at all."""
        if step and self.section.save_interval:
            logger.error("step %d failed; saving the last complete step (%d) before stopping", step + 1, step)
            self.save(step, sampler_state, tokens_trained)

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether step ``step`` is due a checkpoint and an HF export by their intervals."""
        section = self.section
        return (bool(section.save_interval) and step % section.save_interval == 0,
                bool(section.hf_interval) and step % section.hf_interval == 0)

    def export_hf(self, step: int) -> None:
        """Writes the student as an HF checkpoint to ``out/hf/step_N`` in ``checkpoint.hf_dtype`` (collective)."""
        dtype = self.section.hf_dtype
        with self.timers("hf_export"):
            save_hf(self.student.chunks, run_dir.hf_export(self.out, step), dtype=dtype and getattr(torch, dtype),
                    tokenizer_source=self.config.student.tokenizer_path)
