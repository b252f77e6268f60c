"""Teacher service benchmark: scoring throughput and bytes on the wire per response token.

Runs a proxy and one worker in this process on loopback with a tiny random teacher (built in a temp
dir, nothing downloaded), scores batches of varied lengths through the zmq client, and compares the
packed wire format with sending the same data as dense padded ``[B, S, k]`` arrays (int64 ids,
float32 log-probs, float32 token log-probs ``[B, S]``, as a trainer-side tensor would be).

    .venv/bin/python benchmarks/teacher.py                     # hf backend, k = 64 and 256
    .venv/bin/python benchmarks/teacher.py --backend vllm      # in-process vLLM (CPU: slow start)
    .venv/bin/python benchmarks/teacher.py --backend megatron  # Megatron-Core, one rank (TP=1)
"""

import argparse
import os
import tempfile
import time

import numpy as np

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.tiny_teacher import build_tiny_teacher


def make_batch(rng, batch_size: int, top_k: int, vocab: int) -> ScoreBatch:
    """Prompts of 16-64 tokens and responses of 16-256 tokens, like a ragged rollout batch."""
    sequences = []
    for _ in range(batch_size):
        prompt, response = int(rng.integers(16, 65)), int(rng.integers(16, 257))
        sequences.append(SequenceRequest(token_ids=rng.integers(3, vocab, prompt + response),
                                         response_start=prompt))
    return ScoreBatch(sequences=sequences, top_k=top_k)


def wire_bytes(batch: ScoreBatch, outputs) -> tuple[int, int, float]:
    """(request bytes, result bytes, seconds to encode + decode + validate the result) for ``batch``."""
    request = sum(len(f) for f in codec.encode_request("0" * 32, batch, None))
    start = time.perf_counter()
    frames = codec.encode_result("0" * 32, outputs, None)
    codec.decode_result(wire.decode(frames, wire.Limits()), batch)
    return request, sum(len(f) for f in frames), time.perf_counter() - start


def dense_bytes(batch: ScoreBatch) -> int:
    """Bytes of the same result as dense padded arrays ``[B, S, k]`` (S = longest response)."""
    b, s, k = len(batch.sequences), max(x.num_response_tokens for x in batch.sequences), batch.top_k
    return b * s * k * (8 + 4) + b * s * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm", "megatron"))
    parser.add_argument("--top-k", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-batches", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    setup_logging("WARNING")

    model_dir = build_tiny_teacher(tempfile.mkdtemp(prefix="teacher_bench_"), vocab_size=args.vocab_size)
    kwargs = {"max_top_k": max(args.top_k)}
    if args.backend == "vllm":
        kwargs.update(max_model_len=1024, enforce_eager=True)
    if args.backend == "megatron":  # a one-rank process group, as torchrun would describe it
        from megatron_gkd.testing.distributed import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = build_backend(args.backend, model=str(model_dir), **kwargs)
    proxy = Proxy("tcp://127.0.0.1:0").start()  # workers on a private IPC socket
    worker = Worker(proxy.backend_address, backend).start()
    client = build_client("zmq", address=proxy.frontend_address, retry=RetryPolicy(attempt_timeout_s=600))
    rng = np.random.default_rng(0)
    rows = []
    try:
        for top_k in args.top_k:
            batches = [make_batch(rng, args.batch_size, top_k, args.vocab_size) for _ in range(args.num_batches)]
            client.score(batches[0])  # warm-up
            tokens = request_bytes = result_bytes = dense = 0
            elapsed = codec_s = 0.0
            for batch in batches:
                start = time.perf_counter()
                outputs = client.score(batch)
                elapsed += time.perf_counter() - start
                tokens += sum(s.num_response_tokens for s in batch.sequences)
                request, result, seconds = wire_bytes(batch, outputs)
                request_bytes, result_bytes = request_bytes + request, result_bytes + result
                codec_s += seconds
                dense += dense_bytes(batch)
            rows.append((top_k, tokens / elapsed, request_bytes / tokens, result_bytes / tokens,
                         dense / tokens, 1e6 * codec_s / tokens))
    finally:
        client.close()
        worker.close()
        proxy.close()
        backend.close()

    print(f"backend={args.backend} batch_size={args.batch_size} batches={args.num_batches} "
          f"vocab={args.vocab_size} (tiny random teacher, 2 layers, hidden 128)")
    print("| k | scored tokens/s | request B/token | result B/token (packed) | dense [B,S,k] B/token "
          "| dense / packed | result codec us/token |")
    print("|---|---|---|---|---|---|---|")
    for top_k, rate, request, result, dense, codec_us in rows:
        print(f"| {top_k} | {rate:,.0f} | {request:.1f} | {result:,.0f} | {dense:,.0f} | "
              f"{dense / result:.2f}x | {codec_us:.2f} |")


if __name__ == "__main__":
    main()
