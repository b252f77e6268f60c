"""Offline conversion between HF checkpoints and Megatron-Core distributed checkpoints.

Run under torchrun; the parallel layout is the one the checkpoint is written with (hf-to-mcore) or read
with (mcore-to-hf), and the two may differ (``dist_checkpointing`` reshards)::

    torchrun --nproc_per_node 2 -m megatron_gkd.models.convert hf-to-mcore \\
        --hf path/to/hf --out path/to/mcore --tensor-model-parallel-size 2
    torchrun --nproc_per_node 1 -m megatron_gkd.models.convert mcore-to-hf \\
        --mcore path/to/mcore --out path/to/hf-out

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
from megatron_gkd.models.export import TOKENIZER_FILES, commit_output, partial_output, save_hf
from megatron_gkd.models.hf_config import read_hf_config
from megatron_gkd.models.loading import load_hf

logger = logging.getLogger(__name__)

HF_SUBDIR = "hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.models.convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_mcore = commands.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF checkpoint directory")
    to_hf = commands.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--mcore", required=True, help="checkpoint directory written by hf-to-mcore")
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


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    setup_logging("INFO")

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
