"""Smoke job: a tiny Megatron-Core GPT trained on the CPU (or GPU) with tensor parallelism.

Proves the stack (platform layer, parallel runtime, Megatron schedules and optimizer) end to end until
the distillation trainer replaces it as the default job. Run under torchrun:

    torchrun --standalone --nproc_per_node 2 launch/smoke_mcore.py --tensor-model-parallel-size 2
"""

import argparse
import json
import logging
import os
import pathlib

logger = logging.getLogger("smoke_mcore")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--output-dir",
        default=os.environ.get("MEGATRON_GKD_OUTPUT_DIR", "outputs/smoke"),
        help="where metrics.json is written (env MEGATRON_GKD_OUTPUT_DIR; default outputs/smoke)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from megatron_gkd import platform

    platform.setup()
    from megatron_gkd import parallel
    from megatron_gkd.testing import mcore

    state = parallel.initialize(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    try:
        spec = mcore.TinyGPTSpec()
        chunks = mcore.build_model_chunks(spec, state)
        optimizer = mcore.build_optimizer(spec, chunks)
        losses = []
        for step, microbatches in enumerate(mcore.synthetic_batches(spec, args.steps)):
            loss = mcore.train_step(spec, chunks, optimizer, microbatches)
            losses.append(loss)
            if loss is not None and state.tp_rank == 0:
                logger.info("step %d/%d loss %.6f", step + 1, args.steps, loss)
        if state.rank == state.world_size - 1:  # a last-stage rank holds the losses
            out = pathlib.Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            metrics = {"platform": platform.current().name, "world_size": state.world_size,
                       "tensor_model_parallel_size": args.tensor_model_parallel_size,
                       "pipeline_model_parallel_size": args.pipeline_model_parallel_size, "loss": losses}
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
            logger.info("smoke job done: %d steps, final loss %.6f; metrics in %s",
                        args.steps, losses[-1], (out / "metrics.json").resolve())
    finally:
        parallel.destroy()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
