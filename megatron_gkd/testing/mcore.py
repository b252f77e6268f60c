"""A tiny Megatron-Core GPT trained with Megatron's own schedules and optimizer.

The workload of the parallel-layout and checkpoint tests: it
builds one ``GPTModel`` per virtual-pipeline chunk (local layer spec, or the MoE spec), wraps them in
Megatron's ``DistributedDataParallel``, and steps them with ``get_forward_backward_func`` and
``get_megatron_optimizer`` (gradient clipping on). Call :func:`megatron_gkd.parallel.initialize` first.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Iterator

import torch

from megatron_gkd.models import global_name
from megatron_gkd.parallel import ParallelState, run_schedule, seed, shard_for_rank
from megatron_gkd.trainer import optim
from megatron_gkd.trainer.optim import OptimizerConfig, build_lr_scheduler, wrap_for_training


@dataclasses.dataclass(kw_only=True)
class TinyGPTSpec:
    """Shape of the tiny model and of its training batches."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 2
    num_query_groups: int | None = None
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    seq_length: int = 16
    gated_linear_unit: bool = True
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    micro_batch_size: int = 2
    num_microbatches: int = 4
    lr: float = 1e-3
    clip_grad: float = 1.0
    seed: int = 1234
    lr_warmup_steps: int = 2
    """Linear warm-up of :func:`build_scheduler` from ``lr / 10`` to ``lr``."""
    lr_decay_steps: int = 10
    """Cosine decay of :func:`build_scheduler` from ``lr`` to ``lr / 10`` after the warm-up."""
    bf16: bool = False
    """bf16 parameters with fp32 main parameters in the optimizer (Megatron's Float16 optimizer)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""
    tie_embeddings: bool = False
    """The output layer is the word embedding (``share_embeddings_and_output_weights``), as SmolLM2's and Qwen3-0.6B's."""

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def transformer_config(spec: TinyGPTSpec, state: ParallelState):
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if spec.num_moe_experts:
        moe = dict(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            moe_ffn_hidden_size=spec.ffn_hidden_size,
        )
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit,
        activation_func=torch.nn.functional.silu if spec.gated_linear_unit else torch.nn.functional.gelu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=spec.params_dtype,
        params_dtype=spec.params_dtype,
        bf16=spec.bf16,
        use_cpu_initialization=True,
        **state.config.transformer_config_kwargs(),
        **moe,
    )


def build_model_chunks(spec: TinyGPTSpec, state: ParallelState) -> list[torch.nn.Module]:
    """One DDP-wrapped ``GPTModel`` per virtual-pipeline chunk of this rank."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    seed(spec.seed)
    config = transformer_config(spec, state)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, moe_grouped_gemm=False)
    vpp = state.config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=state.is_first_stage(stage),
            post_process=state.is_last_stage(stage),
            position_embedding_type="rope",
            share_embeddings_and_output_weights=spec.tie_embeddings,
            vp_stage=stage,
        ))
    return wrap_for_training(chunks, optimizer_config(spec))


def optimizer_config(spec: TinyGPTSpec):
    """The library's optimizer section for ``spec``: Adam, clipping, warm-up from ``lr / 10``, cosine
    decay to ``lr / 10``."""
    return OptimizerConfig(
        lr=spec.lr, min_lr=spec.lr / 10, lr_warmup_init=spec.lr / 10, lr_warmup_steps=spec.lr_warmup_steps,
        lr_decay_steps=spec.lr_decay_steps, lr_decay_style="cosine", clip_grad=spec.clip_grad,
        use_distributed_optimizer=spec.use_distributed_optimizer,
    )


def build_optimizer(spec: TinyGPTSpec, chunks: list[torch.nn.Module]):
    """Megatron's optimizer (Adam, fp32 main parameters, gradient clipping at ``spec.clip_grad``)."""
    return optim.build_optimizer(optimizer_config(spec), chunks, dtype=spec.params_dtype)


def build_scheduler(spec: TinyGPTSpec, optimizer):
    """Megatron's ``OptimizerParamScheduler``: linear warm-up, then cosine decay (see ``spec``)."""
    return build_lr_scheduler(optimizer_config(spec), optimizer, num_steps=spec.lr_decay_steps)


class SyntheticData:
    """An endless, resumable stream of per-step micro-batches, identical on every rank and layout.

    Step ``n``'s micro-batches depend only on ``(seed, n)``, so restoring :meth:`state_dict` (the
    position) resumes the stream exactly where it was, which is what checkpoints must prove.
    """

    def __init__(self, spec: TinyGPTSpec, seed: int | None = None):
        self.spec = spec
        self.seed = spec.seed + 1 if seed is None else seed
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> list[torch.Tensor]:
        spec = self.spec
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        shape = (spec.num_microbatches, spec.micro_batch_size, spec.seq_length + 1)
        tokens = torch.randint(0, spec.vocab_size, shape, generator=generator)
        self.position += 1
        return list(tokens.unbind(0))

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.seed = int(state["seed"])


def synthetic_batches(spec: TinyGPTSpec, num_steps: int) -> list[list[torch.Tensor]]:
    """``[step][microbatch]`` token tensors ``[b, s+1]``, identical on every rank and layout."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    shape = (num_steps, spec.num_microbatches, spec.micro_batch_size, spec.seq_length + 1)
    tokens = torch.randint(0, spec.vocab_size, shape, generator=generator)
    return [[tokens[step, mb] for mb in range(spec.num_microbatches)] for step in range(num_steps)]


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    # output_tensor: per-token cross entropy [b, s]
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    # Cloned: the schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[torch.Tensor], model: torch.nn.Module):
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    output = model(inputs, position_ids, attention_mask=None, labels=labels)
    return output, partial(_loss_func, torch.ones_like(labels, dtype=torch.float32))


def train_step(
    spec: TinyGPTSpec, chunks, optimizer, microbatches: list[torch.Tensor], scheduler=None
) -> float | None:
    """One optimizer step over ``microbatches``; returns the mean loss on the last stage, else ``None``.

    With a ``scheduler`` (:func:`build_scheduler`), it advances by one step after the update.
    """
    from megatron.core.distributed import finalize_model_grads

    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_schedule(chunks, _forward_step, microbatches, seq_length=spec.seq_length,
                          micro_batch_size=spec.micro_batch_size, forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    if not update_successful:
        raise RuntimeError("optimizer step was skipped (non-finite gradients)")
    if scheduler is not None:
        scheduler.step(1)
    if not losses:
        return None
    return float(torch.stack([entry["lm loss"] for entry in losses]).mean())


def global_parameter_name(chunk: torch.nn.Module, name: str) -> str:
    """``name`` of a parameter in ``chunk`` (DDP-wrapped or not) with global layer and expert indices."""
    return global_name(chunk.module if hasattr(chunk, "module") else chunk, name)


def _is_gated_fc1(chunk: torch.nn.Module, name: str) -> bool:
    return chunk.config.gated_linear_unit and re.search(r"linear_fc1\.(weight|bias)$", name) is not None


def full_state_dict(chunks) -> dict[str, torch.Tensor]:
    """Global-named parameters of a TP=1, PP=1 model (the reference layout)."""
    state = {}
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        for name, param in module.named_parameters():
            state[global_parameter_name(chunk, name)] = param.detach().clone()
    return state


def load_full_state_dict(chunks, full: dict[str, torch.Tensor], state: ParallelState) -> None:
    """Copies this rank's shards of a reference (TP=1, PP=1) state into ``chunks``."""
    tp_size = state.config.tensor_model_parallel_size
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        for name, param in module.named_parameters():
            value = full[global_parameter_name(chunk, name)]
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                parts = 2 if _is_gated_fc1(chunk, name) else 1
                value = shard_for_rank(value, param.partition_dim, state.tp_rank, tp_size, num_parts=parts)
            with torch.no_grad():
                param.copy_(value)
