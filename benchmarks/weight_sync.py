"""Weight sync end to end: trainer shards (TP=2, 2 gloo ranks) -> weights in use by vLLM (1 rank).

A random ~92M-parameter Llama (24 layers, 219 HF tensors, fp32) is loaded with ``load_hf`` on two
trainer ranks; a third process holds a vLLM engine of the same model. The clock runs on the rollout
rank from a barrier of the weight-sync group to the end of vLLM's in-place reload (or, for the
transport-only rows, to the last HF tensor ready on the receiver)::

    python benchmarks/weight_sync.py [--bucket-size-mb 512 64 16] [--repeats 3] [--checksum sum]
                                     [--modes PREFIX ...] [--workdir DIR]

End-to-end modes (into vLLM):
  floor+reload     one broadcast of the plan's bytes, already in one buffer, then vLLM's reload of
                   views into that buffer: the least any protocol can do (no gather, no packing, no
                   copy-out)
  per_tensor       each tensor all-gathered over TP, broadcast by its owner, streamed into one reload
  per_slice        each TP slice broadcast by the rank that holds it (no gather), concatenated on the
                   receiver, streamed into one reload
  bucketed, direct the protocol, ``transfer="direct"`` (the default over gloo): every TP rank broadcasts
                   its own slices from the parameters into their place in the receiver's arena;
                   per-part checksum; 2 buckets in flight
  bucketed, packed the protocol, ``transfer="packed"`` (the default on accelerators): every TP rank
                   packs its slices into its part of each bucket; the receiver copies them out
Transport-only modes (no vLLM; the receiver drops each tensor once it is ready):
  floor            one broadcast of the plan's bytes in a single buffer
  floor, 2 senders each trainer rank broadcasts half of the bytes in a single buffer, at once
  bucketed, ..., no load  the protocol up to the HF tensors on the receiver
Loading alone:
  reload_only      vLLM's in-place reload of tensors already in memory

Prints a Markdown table (best of ``--repeats``). Timings are host timings on a shared machine; a floor
sample is taken before every run, and ratios are to the best of them.
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
    from megatron_gkd.models import export_hf_shards, export_hf_weights, load_hf
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
    single = torch.zeros(plan.num_bytes, dtype=torch.uint8) if rank == 0 else None
    halves = torch.zeros(plan.num_bytes // 2, dtype=torch.uint8)
    for mode, config in modes:
        sender = WeightSender(plan, transport, config) if config is not None else None
        for _ in range(repeats):
            # A floor sample before every run: the machine's speed drifts (it is shared).
            transport.barrier()
            if rank == 0:
                transport.group_of(0).broadcast(single, 0).wait()
            transport.barrier()
            version += 1
            if mode == "floor, 2 senders":
                transport.group_of(rank).broadcast(halves, 0).wait()
            elif mode.startswith("floor") and rank == 0:
                transport.group_of(0).broadcast(single, 0).wait()
            elif mode == "per_tensor":
                for _, tensor in export_hf_weights(chunks):
                    transport.group_of(rank).broadcast(tensor.contiguous(), 0).wait()
            elif mode == "per_slice":
                for _, _, piece in export_hf_shards(chunks):
                    transport.group_of(rank).broadcast(piece.contiguous(), 0).wait()
            elif sender is not None:
                sender.sync(chunks, version)
    transport.close()
    parallel.destroy()
    return dict(plan_s=plan_s, export_s=export_s, num_bytes=plan.num_bytes, num_tensors=len(plan.entries))


def _rollout(path, sync_port, modes, repeats):
    import torch

    from megatron_gkd.rollout import RolloutEngine
    from megatron_gkd.testing.weight_sync import make_engine
    from megatron_gkd.weight_sync import TorchDistributedTransport, WeightReceiver, connect_rollout, reload_vllm_weights

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT="29517")
    transport = TorchDistributedTransport(address="127.0.0.1", port=sync_port, rank=2, num_trainer_ranks=2, num_rollout_ranks=1)
    plan = connect_rollout(transport)
    engine = make_engine(path)
    llm = engine.llm
    times = {}

    def per_tensor():
        for entry in plan.entries:
            tensor = torch.empty(entry.shape, dtype=entry.torch_dtype)
            transport.group_of(entry.owner).broadcast(tensor, 0).wait()
            yield entry.name, tensor

    def per_slice():
        for entry in plan.entries:
            pieces = []
            for holder in entry.shards:
                pieces.append(torch.empty(entry.shard_shape, dtype=entry.torch_dtype))
                transport.group_of(holder).broadcast(pieces[-1], 0).wait()
            yield entry.name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=entry.tp_dim)

    def views(buffer):
        offset = 0
        for entry in plan.entries:
            yield entry.name, buffer[offset : offset + entry.num_bytes].view(entry.torch_dtype).view(entry.shape)
            offset += entry.num_bytes

    class Sink(RolloutEngine):
        """Drops each tensor once it is ready (the transport-only rows)."""

        def generate(self, prompts, sampling):
            raise NotImplementedError

        def load_weights(self, named_tensors, version):
            for _ in named_tensors:
                pass
            self._weight_version = version

    sink = Sink(max_model_len=1)
    resident = [(e.name, torch.randn(e.shape, dtype=e.torch_dtype) * 0.02) for e in plan.entries]
    single = torch.empty(plan.num_bytes, dtype=torch.uint8)
    floors, memory = [], {}
    for mode, config in modes:
        receiver = WeightReceiver(plan, transport, config) if config is not None else None
        best = float("inf")
        for _ in range(repeats):
            transport.barrier()
            start = time.perf_counter()
            transport.group_of(0).broadcast(single, 0).wait()
            floors.append(time.perf_counter() - start)
            transport.barrier()
            start = time.perf_counter()
            if mode == "floor":
                transport.group_of(0).broadcast(single, 0).wait()
            elif mode == "floor, 2 senders":
                halves = single[: plan.num_bytes // 2], single[plan.num_bytes // 2 : plan.num_bytes // 2 * 2]
                works = [transport.group_of(owner).broadcast(half, 0) for owner, half in zip((0, 1), halves)]
                for work in works:
                    work.wait()
            elif mode == "floor+reload":
                transport.group_of(0).broadcast(single, 0).wait()
                reload_vllm_weights(llm, views(single))
            elif mode == "per_tensor":
                reload_vllm_weights(llm, per_tensor())
            elif mode == "per_slice":
                reload_vllm_weights(llm, per_slice())
            elif mode == "reload_only":
                reload_vllm_weights(llm, iter(resident))
            elif mode.endswith("no load"):
                receiver.sync(sink)
            else:
                receiver.sync(engine)
            best = min(best, time.perf_counter() - start)
        if receiver is not None:
            memory[mode] = receiver.buffer_bytes
            receiver = None  # frees its buffers before the next mode allocates
        times[mode] = best
    times["floor"] = min(floors + [times["floor"]])
    times["floor samples"] = sorted(floors)
    times["memory"] = memory
    transport.close()
    engine.close()
    return times


def _body(path, trainer_port, sync_port, modes, repeats):
    if int(os.environ["RANK"]) < 2:
        return _trainer(path, trainer_port, sync_port, modes, repeats)
    return _rollout(path, sync_port, modes, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-size-mb", type=float, nargs="+", default=[512.0, 64.0, 16.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--checksum", default="sum", help="weight_sync.checksum of the bucketed modes")
    parser.add_argument("--modes", nargs="*", default=None, help="only these modes (plus the floors), by name prefix")
    args = parser.parse_args()

    from megatron_gkd import platform

    platform.setup("cpu")
    from megatron_gkd.testing.distributed import free_port, run_distributed
    from megatron_gkd.testing.hf_models import make_tiny_checkpoint
    from megatron_gkd.weight_sync import WeightSyncConfig

    modes = [("floor", None), ("floor, 2 senders", None), ("floor+reload", None), ("per_tensor", None), ("per_slice", None)]
    for suffix in ("", ", no load"):
        for size in args.bucket_size_mb:
            for transfer in ("direct", "packed"):
                modes.append((f"bucketed {size:g} MiB, {transfer}{suffix}",
                              WeightSyncConfig(bucket_size_mb=size, transfer=transfer, checksum=args.checksum)))
    modes.append(("reload_only", None))
    if args.modes:
        modes = [(m, c) for m, c in modes if m.startswith("floor") or any(m.startswith(p) for p in args.modes)]
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
    floors = times["floor samples"]
    print(f"checksum {args.checksum}; floor: best {times['floor']:.3f} s, median {floors[len(floors) // 2]:.3f} s over "
          f"{len(floors)} samples taken before every run\n")
    print("| mode | time (s) | GiB/s | x floor | x floor+reload | receiver buffers (MiB) |")
    print("|---|---|---|---|---|---|")
    for mode, _ in modes:
        kept = times["memory"].get(mode)
        print(f"| {mode} | {times[mode]:.3f} | {gib / times[mode]:.2f} | {times[mode] / times['floor']:.2f} "
              f"| {times[mode] / times['floor+reload']:.2f} | {'' if kept is None else f'{kept / 2**20:.0f}'} |")


if __name__ == "__main__":
    main()
