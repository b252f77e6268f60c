"""HF -> Megatron: build this rank's chunks and fill them straight from ``*.safetensors``.

Each rank opens the safetensors files (memory-mapped; only headers are parsed up front) and reads, one
tensor at a time, exactly the slices its parameters need: its tensor-parallel slice of its own pipeline
stages' (and virtual chunks') layers, and only its experts under expert parallelism. Nothing larger
than one parameter's HF tensors is ever materialised beyond the rank's own shard.
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch

from megatron_gkd.models.builder import build_model, parallel_state_of
from megatron_gkd.models.checkpoints import resolve_checkpoint
from megatron_gkd.models.hf_config import read_hf_config
from megatron_gkd.models.mapping import mapped_tensors, shard_coordinates, tp_slice_index

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """Tensor-by-tensor, slice-by-slice access to an HF safetensors checkpoint (single file or sharded)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.path = os.fspath(path)
        self._handles: dict[str, object] = {}
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as handle:
                self.weight_map: dict[str, str] = dict(json.load(handle)["weight_map"])
        else:
            files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.path}")
            self.weight_map = {}
            for file in files:
                for name in self._handle(os.path.basename(file)).keys():
                    self.weight_map[name] = os.path.basename(file)

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._safe_open(os.path.join(self.path, file), framework="pt")
        return self._handles[file]

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        return self._handle(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, index: tuple) -> torch.Tensor:
        """``tensor[index]`` of tensor ``name``, reading only the selected bytes."""
        return self._slice(name)[index]

    def close(self) -> None:
        # Dropping the handles unmaps the files.
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_weights(model: torch.nn.Module, checkpoint: SafetensorsCheckpoint, *,
                 maps: SafetensorsCheckpoint | None = None) -> int:
    """Fills every parameter of ``model`` with this rank's slices of the HF tensors (a copy, or a slice of ``maps``);
    returns bytes read.

    Args:
        maps: another open of the same checkpoint, for a model that is never trained (a teacher): a host tensor whose
            shard is one HF tensor's slice as the file stores it (same dtype, contiguous: no fusion, no TP split along
            a later dim) takes that slice of ``maps``'s private memory map as its storage instead of a copy. Loading
            then reads nothing of it, a forward reads the pages it touches (embedding rows of tokens never seen stay
            on disk), and the pages are the page cache's, which the kernel may drop and read again instead of
            swapping. The map lives as long as such a tensor; the copies are read through ``checkpoint``, whose map
            goes (with the pages they touched) when it is closed. A write would copy the page, never reach the
            file; the file must not be rewritten in place while the model lives (reading a truncated page is a
            SIGBUS, as for any mapped checkpoint, transformers' included); one replaced by a rename is safe.

    Raises:
        KeyError: a tensor the mapping needs is missing from the checkpoint.
        ValueError: a parameter has no mapping rule, or shapes disagree with the config.
    """
    num_bytes, state = 0, parallel_state_of(model)
    for name, tensor, rule, fields in mapped_tensors(model, model.hf_model_info.rules):
        _, rank, size = shard_coordinates(rule, state)
        hf_names = rule.hf_names(fields)
        indices = [tp_slice_index(checkpoint.shape(hf_name), dim, rank, size, hf_name)
                   for hf_name, dim in zip(hf_names, rule.tp_dims)]
        slices = [checkpoint.read(hf_name, index) for hf_name, index in zip(hf_names, indices)]
        value = rule.to_megatron(slices)
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{', '.join(hf_names)} give shape {tuple(value.shape)} for {name}, which has shape "
                f"{tuple(tensor.shape)} on this rank; the config does not match the weights"
            )
        with torch.no_grad():
            if (maps is not None and value is slices[0] and tensor.device.type == "cpu" and value.dtype == tensor.dtype
                    and value.is_contiguous()):
                tensor.data = maps.read(hf_names[0], indices[0])  # the build's allocation, never written, is freed
            else:
                tensor.copy_(value)
        num_bytes += sum(piece.numel() * piece.element_size() for piece in slices)
        del slices, value
    return num_bytes


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    state=None,
    use_transformer_engine: bool | None = None,
    in_place: bool = False,
    **config_overrides,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunks with the weights of the HF checkpoint at ``path``.

    Call after :func:`megatron_gkd.parallel.initialize`. Parameters are allocated uninitialised and
    filled slice by slice (see the module docstring for what each rank reads).

    Args:
        path: HF checkpoint directory (``config.json`` and ``*.safetensors``, sharded or not), or a GGUF file
            (dequantized to ``dtype`` into a cached HF directory once: :func:`~megatron_gkd.models.resolve_checkpoint`).
        dtype: parameter dtype (the checkpoint's tensors are converted on copy).
        state: the parallel state (default: the initialised one).
        use_transformer_engine: Transformer Engine layer specs; default: when TE imports.
        in_place: host parameters the file stores as they are take its memory map instead of a copy
            (:func:`load_weights`); only for a model that is never trained.
        config_overrides: ``TransformerConfig`` fields to override (e.g. recompute settings).

    Returns:
        One module per virtual-pipeline chunk of this rank.
    """
    path = resolve_checkpoint(path, dtype=dtype)
    hf_config = read_hf_config(path)
    config_overrides.setdefault("perform_initialization", False)
    chunks = build_model(
        hf_config,
        dtype=dtype,
        state=state,
        source=path,
        use_transformer_engine=use_transformer_engine,
        **config_overrides,
    )
    with SafetensorsCheckpoint(path) as checkpoint, SafetensorsCheckpoint(path) as maps:
        num_bytes = sum(load_weights(chunk, checkpoint, maps=maps if in_place else None) for chunk in chunks)
    logger.info("loaded %.1f MB of %s from %s", num_bytes / 2**20, chunks[0].hf_model_info.architecture.name, path)
    return chunks

