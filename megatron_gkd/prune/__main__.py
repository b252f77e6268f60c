"""``python -m megatron_gkd.prune``: a student HF checkpoint pruned from a teacher HF checkpoint.

    python -m megatron_gkd.prune --teacher TEACHER --out STUDENT --num-layers 10
    python -m megatron_gkd.prune --teacher TEACHER --out STUDENT --hidden-size 0.75 --ffn-hidden-size 0.5 \\
        --calibration prompts.jsonl --num-samples 64 --seq-length 512
    torchrun --nproc_per_node 4 -m megatron_gkd.prune --teacher TEACHER --out STUDENT --num-layers 0.5 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Sizes are counts (``10``) or fractions of the teacher's (``0.5``). Without torchrun it runs as one process. A bad
argument exits with status 2 and one line; the last line of a run is ``megatron-gkd prune: {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megatron_gkd import parallel, platform
from megatron_gkd.child_process import free_port
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.models import read_hf_config
from megatron_gkd.prune.calibration import calibration_tokens
from megatron_gkd.prune.importance import DEPTH_METRICS
from megatron_gkd.prune.run import prune_checkpoint
from megatron_gkd.prune.targets import ModelSizes, PruneTargets, parse_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.prune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="the teacher's HF checkpoint directory")
    parser.add_argument("--out", required=True, help="the student's directory (must not exist)")
    sizes = parser.add_argument_group("what the student keeps (default: the teacher's size)")
    for name in ("num_layers", "hidden_size", "ffn_hidden_size"):
        sizes.add_argument("--" + name.replace("_", "-"), type=_size, metavar="N|FRACTION")
    sizes.add_argument("--num-attention-heads", type=int, metavar="N",
                       help="query heads a layer, a multiple of the query groups kept")
    sizes.add_argument("--num-query-groups", type=int, metavar="N",
                       help="key/value heads a layer (default: all; heads are pruned inside the groups)")
    scoring = parser.add_argument_group("importance")
    scoring.add_argument("--depth-metric", choices=DEPTH_METRICS, default="cosine",
                         help="cosine: 1 - cos(layer input, layer output), one pass; loss: the LM loss increase when "
                              "the layer is skipped, one more pass a layer")
    scoring.add_argument("--calibration", help="a prompt file (JSONL/Parquet, like the trainer's); default: built-in")
    scoring.add_argument("--chat-template", default="auto", help="auto, none, or a .jinja file")
    scoring.add_argument("--tokenizer", help="the tokenizer directory (default: --teacher)")
    scoring.add_argument("--num-samples", type=int, default=16, help="calibration sequences")
    scoring.add_argument("--seq-length", type=int, default=256, help="tokens a calibration sequence")
    scoring.add_argument("--micro-batch-size", type=int, default=1)
    scoring.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the dtype the teacher is scored in")
    layout = parser.add_argument_group("parallel layout (the world size must be a multiple of TP x PP)")
    layout.add_argument("--tensor-model-parallel-size", type=int, default=1)
    layout.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _size(text: str) -> int | float:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _checked_targets(args: argparse.Namespace) -> PruneTargets:
    """The targets, checked against the teacher's config before any process group starts."""
    targets = PruneTargets(num_layers=args.num_layers, hidden_size=args.hidden_size,
                           ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                           num_query_groups=args.num_query_groups)
    targets.resolve(ModelSizes.of(read_hf_config(args.teacher)))
    if os.path.exists(args.out):
        raise ValueError(f"--out {args.out} exists; remove it or choose another directory")
    if args.calibration is not None and not os.path.isfile(args.calibration):
        raise ValueError(f"--calibration {args.calibration} is not a file; give a JSONL or Parquet prompt file")
    return targets


def _one_process_world() -> None:
    """Without torchrun, this process is a world of one (torch.distributed needs a rendezvous all the same)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        targets = _checked_targets(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"prune error: {error}", file=sys.stderr)
        return 2
    _one_process_world()
    platform.setup()
    import torch.distributed as dist

    state = parallel.initialize(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    try:
        tokens = calibration_tokens(args.tokenizer or args.teacher, path=args.calibration, num_samples=args.num_samples,
                                    seq_length=args.seq_length, chat_template=args.chat_template,
                                    show_progress=state.rank == 0)
        result = prune_checkpoint(args.teacher, args.out, targets, tokens, state=state, depth_metric=args.depth_metric,
                                  micro_batch_size=args.micro_batch_size, dtype=DTYPES[args.dtype])
        if state.rank == 0:
            print("megatron-gkd prune: " + json.dumps(result.summary()), flush=True)  # one line, for scripts
    finally:
        parallel.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
