"""Time distributed checkpoint save and load on the tiny Megatron GPT (gloo ranks on this machine).

Times :func:`megatron_gkd.trainer.checkpointing.save_checkpoint` (model, Adam state, scheduler, RNG,
data position; torch_dist format written in-process, fsynced, committed atomically) and
:func:`load_checkpoint` into the same layout::

    .venv/bin/python benchmarks/checkpoint_save_load.py --tensor-model-parallel-size 2 --hidden-size 512
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path


def _body(spec_kwargs: dict, tp: int, repeats: int, root: str) -> dict:
    from megatron_gkd import parallel
    from megatron_gkd.testing.mcore import (
        SyntheticData,
        TinyGPTSpec,
        build_model_chunks,
        build_optimizer,
        build_scheduler,
        train_step,
    )
    from megatron_gkd.trainer import checkpointing

    spec = TinyGPTSpec(**spec_kwargs)
    state = parallel.initialize(tensor_model_parallel_size=tp)
    chunks = build_model_chunks(spec, state)
    optimizer = build_optimizer(spec, chunks)
    scheduler = build_scheduler(spec, optimizer)
    data = SyntheticData(spec)
    train_step(spec, chunks, optimizer, next(data), scheduler=scheduler)  # creates the Adam state
    times = {"save": [], "load": []}
    kwargs = dict(model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, parallel_state=state)
    for repeat in range(repeats):
        start = time.perf_counter()
        checkpointing.save_checkpoint(
            f"{root}/ckpt", repeat, data_state=data.state_dict(), keep_last_n=1, **kwargs
        )
        times["save"].append(time.perf_counter() - start)

        start = time.perf_counter()
        checkpointing.load_checkpoint(f"{root}/ckpt", **kwargs)
        times["load"].append(time.perf_counter() - start)
    num_parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    parallel.destroy()
    return {"times": times, "num_parameters": num_parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megatron_gkd.testing.distributed import run_distributed
    from megatron_gkd.testing.mcore import TinyGPTSpec

    spec = dataclasses.asdict(
        TinyGPTSpec(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.hidden_size // 64,
            ffn_hidden_size=4 * args.hidden_size,
            vocab_size=4096,
            num_microbatches=1,
        )
    )
    tp = args.tensor_model_parallel_size
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_body, tp, args=(spec, tp, args.repeats, root), timeout=1200)
        size = sum(path.stat().st_size for path in Path(root, "ckpt").rglob("*") if path.is_file())
    parameters = sum(result["num_parameters"] for result in results)
    print(
        f"tiny GPT, {parameters / 1e6:.1f} M parameters (+ 2 Adam moments), TP={tp}, "
        f"{size / 2**20:.0f} MiB on disk, {args.repeats} repeats"
    )
    print("| operation | median s (rank 0) | first s (rank 0) |")
    print("|---|---|---|")
    for name, values in results[0]["times"].items():
        print(f"| {name} | {statistics.median(values):.3f} | {values[0]:.3f} |")


if __name__ == "__main__":
    main()
