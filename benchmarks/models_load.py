"""HF -> Megatron load and Megatron -> HF save: time and per-rank peak allocated memory.

Builds a random ~370 MB Llama (``LARGE_LLAMA``) with ``transformers``, then for each tensor-parallel
size runs ``load_hf`` and ``save_hf`` on that many gloo ranks, measuring wall time and the peak
increase of anonymous RSS (``megatron_gkd.testing.memory.AnonPeak``) on every rank::

    python benchmarks/models_load.py --tp 1 2 [--workdir DIR]

Prints a Markdown table. Timings are host timings on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _rank_body(path: str, out: str, tp: int) -> dict:
    import gc

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, save_hf
    from megatron_gkd.testing.memory import AnonPeak

    parallel.initialize(tensor_model_parallel_size=tp)
    gc.collect()
    start = time.perf_counter()
    with AnonPeak() as load_meter:
        chunks = load_hf(path)
    load_s = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
    start = time.perf_counter()
    with AnonPeak() as save_meter:
        save_hf(chunks, out)
    save_s = time.perf_counter() - start
    parallel.destroy()
    return dict(load_s=load_s, load_peak=load_meter.increase, shard=shard, save_s=save_s, save_peak=save_meter.increase)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()

    from megatron_gkd import platform

    platform.setup("cpu")
    from megatron_gkd.testing.distributed import run_distributed
    from megatron_gkd.testing.hf_models import LARGE_LLAMA, make_tiny_checkpoint

    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        path = make_tiny_checkpoint("LlamaForCausalLM", os.path.join(workdir, "hf"), **LARGE_LLAMA)
        model_mb = os.path.getsize(os.path.join(path, "model.safetensors")) / 2**20
        print(f"checkpoint: {model_mb:.0f} MB (float32)\n")
        print("| TP | rank | shard MB | load s | load peak MB | save s | save peak MB |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for tp in args.tp:
            results = run_distributed(_rank_body, tp, args=(path, os.path.join(workdir, f"out-tp{tp}"), tp), timeout=900)
            for rank, r in enumerate(results):
                print(
                    f"| {tp} | {rank} | {r['shard'] / 2**20:.0f} | {r['load_s']:.2f} | {r['load_peak'] / 2**20:.0f} "
                    f"| {r['save_s']:.2f} | {r['save_peak'] / 2**20:.0f} |"
                )


if __name__ == "__main__":
    main()
