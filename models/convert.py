"""Offline conversion between HF checkpoints and Megatron-Core distributed checkpoints, and from GGUF to HF.

Run under torchrun (gguf-to-hf: one process); the parallel layout is the one the checkpoint is written with
(hf-to-mcore) or read with (mcore-to-hf), and the two may differ (``dist_checkpointing`` reshards)::

    torchrun --nproc_per_node 2 -m megatron_gkd.models.convert hf-to-mcore \\
        --hf path/to/hf --out path/to/mcore --tensor-model-parallel-size 2
    torchrun --nproc_per_node 1 -m megatron_gkd.models.convert mcore-to-hf \\
        --mcore path/to/mcore --out path/to/hf-out
    python -m megatron_gkd.models.convert gguf-to-hf --gguf model.Q4_1.gguf --out path/to/hf --dtype bfloat16

``--hf`` also takes a GGUF file (converted through the cache first, :func:`~megatron_gkd.models.resolve_checkpoint`);
gguf-to-hf writes the dequantized HF checkpoint (weights, config, tokenizer, chat template) where you say instead.

The Megatron checkpoint holds ``model`` (or ``model0``, ``model1``... per virtual-pipeline chunk) in
``dist_checkpointing`` format, plus ``hf/``: the HF ``config.json`` and tokenizer files, from which
mcore-to-hf rebuilds the model.

Either output is written whole or not at all: the ranks write into ``<out>.partial`` and rank 0 renames it
to ``<out>`` once every rank's files are on disk, so a conversion that dies leaves no ``<out>`` that looks
finished (a stale ``.partial`` is replaced by the next attempt). An existing ``<out>`` is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import torch

from megatron_gkd import parallel, platform
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.models.builder import build_model
from megatron_gkd.models.checkpoints import resolve_checkpoint
from megatron_gkd.models.export import TOKENIZER_FILES, commit_output, partial_output, save_hf
from megatron_gkd.models.gguf import convert_gguf
from megatron_gkd.models.hf_config import read_hf_config
from megatron_gkd.models.loading import load_hf
from megatron_gkd.planning.gguf_config import gguf_file

logger = logging.getLogger(__name__)

HF_SUBDIR = "hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.models.convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_mcore = commands.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF checkpoint directory or GGUF file")
    to_hf = commands.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--mcore", required=True, help="checkpoint directory written by hf-to-mcore")
    from_gguf = commands.add_parser("gguf-to-hf", help="GGUF file -> HF safetensors (dequantized; no torchrun)")
    from_gguf.add_argument("--gguf", required=True, help="GGUF file, or a directory holding one")
    from_gguf.add_argument("--out", required=True, help="output directory")
    from_gguf.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    for command in (to_mcore, to_hf):
        command.add_argument("--out", required=True, help="output directory")
        command.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        command.add_argument("--tensor-model-parallel-size", type=int, default=1)
        command.add_argument("--pipeline-model-parallel-size", type=int, default=1)
        command.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
        command.add_argument("--expert-model-parallel-size", type=int, default=1)
    return parser


def _model_keys(num_chunks: int) -> list[str]:
    # Megatron's training checkpoints name the chunks this way.
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def sharded_model_state(chunks) -> dict:
    """The ``dist_checkpointing`` sharded state dict of this rank's chunks."""
    return {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(len(chunks)), chunks)}


def hf_to_mcore(hf_path: str, out: str, dtype: torch.dtype) -> None:
    """Loads the HF checkpoint (sliced per rank) and saves it as a Megatron dist checkpoint."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    hf_path = resolve_checkpoint(hf_path, dtype=dtype)  # a GGUF: its converted directory, tokenizer included
    chunks = load_hf(hf_path, dtype=dtype)
    final, out = out, partial_output(out)
    dist_checkpointing.save(sharded_model_state(chunks), out)
    if dist.get_rank() == 0:
        hf_dir = os.path.join(out, HF_SUBDIR)
        os.makedirs(hf_dir, exist_ok=True)
        with open(os.path.join(hf_dir, "config.json"), "w") as handle:
            json.dump(chunks[0].hf_model_info.hf_config, handle, indent=2)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_path, name)):
                shutil.copyfile(os.path.join(hf_path, name), os.path.join(hf_dir, name))
    commit_output(out, final)
    logger.info("wrote Megatron checkpoint %s from %s", final, hf_path)


def mcore_to_hf(mcore_path: str, out: str, dtype: torch.dtype) -> None:
    """Rebuilds the model from ``<mcore>/hf/config.json``, loads the dist checkpoint, saves HF."""
    from megatron.core import dist_checkpointing

    hf_dir = os.path.join(mcore_path, HF_SUBDIR)
    chunks = build_model(read_hf_config(hf_dir), dtype=dtype, source=hf_dir, perform_initialization=False)
    state = dist_checkpointing.load(sharded_model_state(chunks), mcore_path)
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        chunk.load_state_dict(state[key])
    partial = partial_output(out)
    save_hf(chunks, partial)
    commit_output(partial, out)
    logger.info("wrote HF checkpoint %s from %s", out, mcore_path)


def gguf_to_hf(gguf_path: str, out: str, dtype: torch.dtype) -> None:
    """Writes the dequantized HF checkpoint of a GGUF to ``out`` (whole or not at all, as the other commands)."""
    file = gguf_file(gguf_path)
    if file is None:
        raise ValueError(f"--gguf {gguf_path} is not a GGUF file nor a directory holding one")
    if os.path.exists(out):
        raise FileExistsError(f"--out {out} exists; remove it or choose another directory (nothing was written)")
    partial = out.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        convert_gguf(file, partial, dtype=dtype)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, out)
    logger.info("wrote HF checkpoint %s from %s", out, file)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    setup_logging("INFO")
    if args.command == "gguf-to-hf":  # no model parallelism: one process dequantizes
        gguf_to_hf(args.gguf, args.out, DTYPES[args.dtype])
        return

    platform.setup()

    parallel.initialize(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    try:
        if args.command == "hf-to-mcore":
            hf_to_mcore(args.hf, args.out, DTYPES[args.dtype])
        else:
            mcore_to_hf(args.mcore, args.out, DTYPES[args.dtype])
    finally:
        parallel.destroy()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# dist_checkpointing's writer starts a spawn-method multiprocessing Manager that re-imports the main
# module; the guard keeps that child from re-running the conversion (without it the save hung after common.pt).
if __name__ == "__main__":
    main()
