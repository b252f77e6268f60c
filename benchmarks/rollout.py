"""Rollout throughput: generated tokens/s of the vllm engine vs the megatron reference engine.

Both engines sample the same prompts from the same tiny random Llama (built in a temp dir, nothing
downloaded; ``hf_models``' tiny Llama with head_dim 64, ``--layers`` and ``--hidden`` wide), float32,
one process. vLLM runs in this process (single worker); the megatron engine runs in one spawned gloo
rank at TP=1 (Megatron needs a process group). Each engine does one warm-up call, then ``--repeats``
timed calls; tokens/s counts generated response tokens (samples may stop early at EOS).

    .venv/bin/python benchmarks/rollout.py
    .venv/bin/python benchmarks/rollout.py --num-prompts 16 --n 4 --max-tokens 128
"""

import argparse
import os
import tempfile
import time

import numpy as np

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.rollout import EOS_TOKEN_ID, make_rollout_checkpoint


def make_prompts(num_prompts: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 16-64 random tokens, starting with BOS (1)."""
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, vocab, int(rng.integers(15, 64))).tolist()] for _ in range(num_prompts)]


def timed_generate(engine, prompts, sampling, repeats: int) -> tuple[int, float]:
    """(generated tokens, seconds) over ``repeats`` calls after one warm-up call."""
    engine.generate(prompts, sampling)
    tokens, start = 0, time.perf_counter()
    for _ in range(repeats):
        tokens += engine.generate(prompts, sampling).num_generated_tokens
    return tokens, time.perf_counter() - start


def megatron_rank(model_dir, prompts, sampling, repeats, max_model_len, vocab_size):
    """Spawned rank body: the megatron engine at TP=1."""
    import torch

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.rollout import build_engine

    torch.set_num_threads(int(os.environ.get("ROLLOUT_BENCH_THREADS", "1")))
    parallel.initialize()
    engine = build_engine("megatron", chunks=load_hf(model_dir, dtype=torch.float32), max_model_len=max_model_len,
                          eos_token_id=EOS_TOKEN_ID, vocab_size=vocab_size)
    try:
        return timed_generate(engine, prompts, sampling, repeats)
    finally:
        parallel.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    args = parser.parse_args()
    setup_logging("WARNING")
    os.environ["ROLLOUT_BENCH_THREADS"] = str(args.threads)

    vocab_size, max_model_len = 256, 256
    model_dir = make_rollout_checkpoint(tempfile.mkdtemp(prefix="rollout_bench_"), num_hidden_layers=args.layers,
                                        hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                                        num_key_value_heads=args.hidden // 64)
    prompts = make_prompts(args.num_prompts, vocab_size)
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=0)
    print(f"{args.num_prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, layers={args.layers}, "
          f"hidden={args.hidden}, {args.threads} thread(s)")

    rows = []
    (tokens, seconds), = run_distributed(megatron_rank, 1, args=(model_dir, prompts, sampling, args.repeats,
                                                                 max_model_len, vocab_size),
                                         num_threads=args.threads, timeout=3600)
    rows.append(("megatron (reference)", tokens, seconds))

    import torch

    from megatron_gkd.rollout import build_engine

    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    engine = build_engine("vllm", model=model_dir, max_model_len=max_model_len, skip_tokenizer_init=True,
                          kv_cache_memory_bytes=256 << 20)
    try:
        tokens, seconds = timed_generate(engine, prompts, sampling, args.repeats)
    finally:
        engine.close()
    rows.append(("vllm", tokens, seconds))

    print("| engine | generated tokens | seconds | tokens/s |")
    print("|---|---|---|---|")
    for name, tokens, seconds in rows:
        print(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:,.0f} |")


if __name__ == "__main__":
    main()
