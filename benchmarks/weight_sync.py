"""Weight sync end to end: trainer shards (TP=2, 2 gloo ranks) -> weights in use by vLLM (1 rank).

A random ~92M-parameter Llama (24 layers, 219 HF tensors, fp32) is loaded with ``load_hf`` on two
trainer ranks; a third process holds a vLLM engine of the same model. The clock runs on the rollout
rank from a barrier of the weight-sync group to the end of vLLM's in-place reload::

    python benchmarks/weight_sync.py [--bucket-size-mb 512 64] [--repeats 3] [--workdir DIR]

Modes:
  floor        one broadcast of the plan's total bytes in a single buffer (transport only: no TP
               gather, no packing, no load)
  per_tensor   each tensor broadcast by its owner as the exporter yields it, streamed into one reload
  bucketed     the protocol (plan-ordered buckets, checksum, 2 buffers each side)
  bucketed/1buf  the same with one buffer per side (no overlap of gather/pack/send/unpack)
  reload_only  vLLM's in-place reload of tensors already in memory (what loading alone costs)

Prints a Markdown table (best of ``--repeats``). Timings are host timings on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=16384, max_position_embeddings=256, tie_word_embeddings=False)


def _trainer(path, trainer_port, sync_port, modes, repeats):
    import torch
    import torch.distributed as dist

    from megatron_gkd import parallel
    from megatron_gkd.models import export_hf_weights, load_hf
    from megatron_gkd.weight_sync import TorchDistributedTransport, WeightSender, build_plan, connect_trainer

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=rank, world_size=2)
    parallel.initialize(tensor_model_parallel_size=2)
    chunks = load_hf(path)
    start = time.perf_counter()
    plan = build_plan(chunks)
    plan_s = time.perf_counter() - start
    export_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in export_hf_weights(chunks):
            pass
        export_s = min(export_s, time.perf_counter() - start)
    transport = TorchDistributedTransport(address="127.0.0.1", port=sync_port, rank=rank, num_trainer_ranks=2, num_rollout_ranks=1)
    connect_trainer(plan, transport)
    version = 0
    for mode, config in modes:
        sender = WeightSender(plan, transport, config) if config is not None else None
        floor = torch.zeros(plan.num_bytes, dtype=torch.uint8) if mode == "floor" and rank == 0 else None
        for _ in range(repeats):
            transport.barrier()
            version += 1
            if mode == "floor" and rank == 0:
                transport.group_of(0).broadcast(floor, 0).wait()
            elif mode == "per_tensor":
                for _, tensor in export_hf_weights(chunks):
                    transport.group_of(rank).broadcast(tensor.contiguous(), 0).wait()
            elif sender is not None:
                sender.sync(chunks, version)
    transport.close()
    parallel.destroy()
    return dict(plan_s=plan_s, export_s=export_s, num_bytes=plan.num_bytes, num_tensors=len(plan.entries))


def _rollout(path, sync_port, modes, repeats):
    import torch

    from megatron_gkd.testing.weight_sync import make_llm
    from megatron_gkd.weight_sync import TorchDistributedTransport, WeightReceiver, connect_rollout, reload_vllm_weights

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT="29517")
    transport = TorchDistributedTransport(address="127.0.0.1", port=sync_port, rank=2, num_trainer_ranks=2, num_rollout_ranks=1)
    plan = connect_rollout(transport)
    llm = make_llm(path)
    times = {}

    def per_tensor():
        for entry in plan.entries:
            tensor = torch.empty(entry.shape, dtype=entry.torch_dtype)
            transport.group_of(entry.owner).broadcast(tensor, 0).wait()
            yield entry.name, tensor

    resident = [(e.name, torch.randn(e.shape, dtype=e.torch_dtype) * 0.02) for e in plan.entries]
    for mode, config in modes:
        receiver = WeightReceiver(plan, transport, config) if config is not None else None
        floor = torch.empty(plan.num_bytes, dtype=torch.uint8) if mode == "floor" else None
        best = float("inf")
        for _ in range(repeats):
            transport.barrier()
            start = time.perf_counter()
            if mode == "floor":
                transport.group_of(0).broadcast(floor, 0).wait()
            elif mode == "per_tensor":
                reload_vllm_weights(llm, per_tensor())
            elif mode == "reload_only":
                reload_vllm_weights(llm, iter(resident))
            else:
                receiver.sync(llm)
            best = min(best, time.perf_counter() - start)
        if receiver is not None:
            receiver.buffers = []
        times[mode] = best
    transport.close()
    return times


def _body(path, trainer_port, sync_port, modes, repeats):
    if int(os.environ["RANK"]) < 2:
        return _trainer(path, trainer_port, sync_port, modes, repeats)
    return _rollout(path, sync_port, modes, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-size-mb", type=float, nargs="+", default=[512.0, 64.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    from megatron_gkd import platform

    platform.setup("cpu")
    from megatron_gkd.testing.distributed import free_port, run_distributed
    from megatron_gkd.testing.hf_models import make_tiny_checkpoint
    from megatron_gkd.weight_sync import WeightSyncConfig

    modes = [("floor", None), ("per_tensor", None)]
    for size in args.bucket_size_mb:
        modes.append((f"bucketed {size:g} MiB", WeightSyncConfig(bucket_size_mb=size)))
        modes.append((f"bucketed {size:g} MiB, 1 buffer", WeightSyncConfig(bucket_size_mb=size, num_buffers=1)))
    modes.append(("reload_only", None))
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        path = make_tiny_checkpoint("LlamaForCausalLM", os.path.join(workdir, "model"), **MODEL)
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        trainer0, trainer1, times = run_distributed(
            _body, 3, args=(path, free_port(), free_port(), modes, args.repeats), init_process_group=False, timeout=1800, env=env
        )
    gib = trainer0["num_bytes"] / 2**30
    print(f"{trainer0['num_tensors']} HF tensors, {trainer0['num_bytes'] / 2**20:.0f} MiB fp32; "
          f"plan built in {max(trainer0['plan_s'], trainer1['plan_s']) * 1e3:.1f} ms; exporter alone (TP gathers, "
          f"no send) {max(trainer0['export_s'], trainer1['export_s']):.3f} s; best of {args.repeats}\n")
    print("| mode | time (s) | GiB/s | x floor |")
    print("|---|---|---|---|")
    for mode, _ in modes:
        print(f"| {mode} | {times[mode]:.3f} | {gib / times[mode]:.2f} | {times[mode] / times['floor']:.2f} |")


if __name__ == "__main__":
    main()
