"""The bf16 trainer seen from inside: a rank body that runs the real :class:`~megatron_gkd.trainer.loop.Trainer`
on-policy (colocated vLLM) and reports what weight sync put on the wire and what the engine computes with.

vLLM's CPU backend repacks every linear weight for its GEMM kernels after loading and frees the
original parameter, so the engine's weights cannot be read back as tensors. They are read through the
kernels the model runs: ``quant_method.apply(layer, I)`` with the identity ``I`` returns ``W^T``
exactly (each output is ``1 * w``, one product, whatever the accumulation). Embeddings and norms are
read as parameters. The mapping of HF tensors to vLLM's fused modules is Qwen3's (dense).
"""

from __future__ import annotations

import os

import torch

from megatron_gkd.config import load_config
from megatron_gkd.models.export import export_hf_weights
from megatron_gkd.testing.hf_models import read_safetensors_dir
from megatron_gkd.trainer.loop import Trainer
from megatron_gkd.weight_sync import receiver as receiver_module

# vLLM module holding an HF tensor of a Qwen3 layer, and the HF tensors it fuses along dim 0.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_ROW_SPLIT = ("self_attn.o_proj", "mlp.down_proj")  # column shards of the HF weight (row-parallel)


def expected_engine_shards(hf: dict[str, torch.Tensor], num_layers: int, tp_rank: int, tp_size: int) -> dict:
    """What vLLM's TP rank ``tp_rank`` of ``tp_size`` should hold, as ``{vLLM weight name: tensor}``, for
    the full HF tensors ``hf`` of a dense Qwen3 (linear weights as ``[out, in]``)."""
    def rows(t):
        return t.chunk(tp_size, dim=0)[tp_rank]

    expected = {"model.embed_tokens.weight": rows(hf["model.embed_tokens.weight"]),
                "lm_head.weight": rows(hf["lm_head.weight"]), "model.norm.weight": hf["model.norm.weight"]}
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            expected[f"{prefix}{norm}.weight"] = hf[f"{prefix}{norm}.weight"]
        for fused, parts in _FUSED.items():
            expected[f"{prefix}{fused}.weight"] = torch.cat([rows(hf[f"{prefix}{p}.weight"]) for p in parts])
        for name in _ROW_SPLIT:
            expected[f"{prefix}{name}.weight"] = hf[f"{prefix}{name}.weight"].chunk(tp_size, dim=1)[tp_rank]
    return expected


def engine_weights(worker) -> dict[str, tuple[str, torch.Tensor]]:
    """``{name: (model dtype, weight as the engine computes with it)}`` of this vLLM worker (run through
    ``llm.collective_rpc``): linear layers through their kernels, everything else as stored."""
    model = worker.model_runner.model
    dtype = _name(model_dtype(worker))
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if hasattr(module, "cpu_linear"):  # a repacked linear (lm_head too): read it through its kernel
            size = module.input_size_per_partition if hasattr(module, "input_size_per_partition") else weight.shape[1]
            identity = torch.eye(size, dtype=model_dtype(worker))
            with torch.no_grad():
                found[f"{name}.weight"] = module.quant_method.apply(module, identity).t().contiguous()
        else:
            found[f"{name}.weight"] = weight.detach().clone()
    return {name: (dtype, tensor) for name, tensor in found.items()}


def model_dtype(worker) -> torch.dtype:
    return worker.model_runner.model_config.dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def on_policy_rank(config_path: str, overrides: list[str]) -> dict:
    """Trains ``config_path`` + ``overrides`` with the real trainer (a rank of ``run_distributed(...,
    init_process_group=False)``), recording each tensor the colocated weight sync hands to vLLM.

    Returns (every rank): the run's summary, the dtypes seen on the wire per sync, the errors
    ``weight_sync.verify`` measured (when it is on), the engine's tensors
    (read after the last sync) that differ from the trainer's weights and those that still equal the
    initial checkpoint; rank 0 also returns the trainer's HF tensors.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    verify_errors: list[float] = []  # weight_sync.verify's |vLLM - student| prompt log-prob error per sync
    check = receiver_module.check_prompt_logprobs

    def recording_check(got, expected, tolerance, version):
        verify_errors.append((got - expected).abs().max().item())
        return check(got, expected, tolerance, version)

    receiver_module.check_prompt_logprobs = recording_check
    trainer = Trainer(load_config(config_path, overrides))
    try:
        engine = trainer.rollout.engine
        wire: list[dict[str, str]] = []
        load_weights = engine.load_weights

        def recording_load(named_tensors, version):
            seen = {}

            def record():
                for name, tensor in named_tensors:
                    seen[name] = _name(tensor.dtype)
                    yield name, tensor

            load_weights(record(), version)
            wire.append(seen)

        engine.load_weights = recording_load
        summary = trainer.train()
        hf = {name: tensor.clone() for name, tensor in export_hf_weights(trainer.student.chunks, owner_only=False)}
        [held] = engine.llm.collective_rpc(engine_weights)
        tp = trainer.config.rollout.tensor_parallel_size
        rank = int(os.environ["RANK"])
        expected = expected_engine_shards(hf, trainer.student.hf_config["num_hidden_layers"], rank % tp, tp)
        mismatched = sorted(name for name in expected if name not in held
                            or not torch.equal(held[name][1], expected[name]))
        # The read-back can tell weights apart: none still equals the checkpoint vLLM started from.
        initial = {name: tensor.to(hf[name].dtype) for name, tensor in
                   read_safetensors_dir(trainer.config.student.checkpoint).items()}
        initial = expected_engine_shards(initial, trainer.student.hf_config["num_hidden_layers"], rank % tp, tp)
        unchanged = sorted(name for name in initial if name in held and torch.equal(held[name][1], initial[name]))
        return dict(summary=summary, wire=wire, trainer=hf if rank == 0 else None, verify_errors=verify_errors,
                    engine_dtypes=sorted({d for d, _ in held.values()} | {_name(t.dtype) for _, t in held.values()}),
                    compared=len(expected), mismatched=mismatched, unchanged=unchanged,
                    extra=sorted(set(held) - set(expected)))
    finally:
        trainer.close()
