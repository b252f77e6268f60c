"""Per-device memory of a vLLM teacher engine scoring the student's samples.

A teacher device holds its weight shard, the KV cache of the sequences it scores at once, the
activations of one engine step and, on the last pipeline stage, the logits of prompt log-probs:
vLLM turns every scored token's logits into float32 log-probabilities over the whole vocabulary
(``[tokens, vocab]``, log-softmax beside the float32 cast) before taking the top k, which for a
129k vocabulary and 8192 tokens per step is about 8 GiB. ``max_num_batched_tokens`` bounds it.

KV cache per token and layer: grouped-query attention keeps ``2 x kv_heads x head_dim`` split over
TP (a rank keeps at least one head: vLLM replicates heads when TP exceeds them); multi-latent
attention keeps the compressed ``kv_lora_rank + qk_rope_head_dim`` latent (576 for DeepSeek-V3),
which every TP rank holds whole.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_gkd.planning.cluster import Device
from megatron_gkd.planning.layout import Batch, TeacherLayout
from megatron_gkd.planning.model import ModelShape, model_shape
from megatron_gkd.planning.params import (
    VLLM,
    ParameterCounts,
    count_parameters,
    layer_tensors,
    output_tensors,
    padded_vocab,
    shard_elements,
)
from megatron_gkd.planning.student import MemoryBreakdown

ACTIVATION_BYTES = 2  # vLLM serves in bf16 (FP8 checkpoints compute in bf16 too)


@dataclasses.dataclass(kw_only=True)
class TeacherRank:
    pp_rank: int
    num_layers: int
    parameters: int
    memory: MemoryBreakdown
    kv_bytes_per_token: int
    kv_capacity_tokens: int | None = None
    """Tokens of KV cache that fit beside everything else (``None`` without a device)."""
    problem: str | None = None
    """Why this stage does not fit the device."""


@dataclasses.dataclass(kw_only=True)
class TeacherPlan:
    architecture: str
    layout: TeacherLayout
    counts: ParameterCounts
    weights_dtype: str
    ranks: list[TeacherRank]
    notes: list[str]
    device: Device | None = None

    @property
    def problems(self) -> list[str]:
        """Why the plan does not fit the device (empty: it fits, or no device was given)."""
        return [rank.problem for rank in self.ranks if rank.problem]

    @property
    def peak(self) -> TeacherRank:
        return max(self.ranks, key=lambda rank: rank.memory.total)

    @property
    def feasible(self) -> bool:
        return not self.problems


def vllm_stage_layers(num_layers: int, pp: int) -> list[range]:
    """Layers per pipeline rank as vLLM assigns them (``get_pp_indices``): the remainder goes to the
    stages before the last, last-but-one first."""
    partitions = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        partitions[-i] += 1
    starts = [sum(partitions[:r]) for r in range(pp)]
    return [range(starts[r], starts[r] + partitions[r]) for r in range(pp)]


def _check_splits(m: ModelShape, layout: TeacherLayout) -> None:
    tp = layout.tensor_parallel_size
    if m.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={m.num_attention_heads} does not split over tensor_parallel_size={tp}")
    if m.num_key_value_heads % tp and tp % m.num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads={m.num_key_value_heads} and tensor_parallel_size={tp}: one must divide the other"
        )
    if layout.pipeline_parallel_size > m.num_layers:
        raise ValueError(f"pipeline_parallel_size={layout.pipeline_parallel_size} exceeds the {m.num_layers} layers")
    if layout.enable_expert_parallel:
        if not m.is_moe:
            raise ValueError("enable_expert_parallel needs a model with routed experts")
        if m.num_experts % (tp * layout.data_parallel_size):
            raise ValueError(f"{m.num_experts} experts do not split over TP x DP = {tp * layout.data_parallel_size}")


def _quantized_bytes(t, n: int, m: ModelShape, weights: str) -> int:
    if weights == "fp8":  # a float32 scale per 128 x 128 block (vLLM shards along whole blocks)
        block = m.fp8_block or (128, 128)
        return n + 4 * math.ceil(n / math.prod(block))
    if weights == "int8":  # a float32 scale per output channel
        return n + 4 * math.ceil(n / t.shape[1])
    return ACTIVATION_BYTES * n


def _weights(m: ModelShape, layout: TeacherLayout, weights: str, pp_rank: int, layers: range) -> tuple[int, int]:
    """(parameter elements, bytes) of one rank of ``pp_rank``."""
    tp = layout.tensor_parallel_size
    ep = tp * layout.data_parallel_size if layout.enable_expert_parallel else 1
    tensors = [t for layer in layers for t in layer_tensors(m, m.moe_layers[layer])]
    num_vocab_tensors = int(pp_rank == 0)
    if pp_rank == layout.pipeline_parallel_size - 1:
        tensors += [t for t in output_tensors(m) if t.group != "output"]
        # The output layer: its own tensor unless tied to an embedding on the same rank.
        num_vocab_tensors += int(not m.tie_word_embeddings or layout.pipeline_parallel_size > 1)
    elements = nbytes = 0
    for t in tensors:
        n = shard_elements(t, m, engine=VLLM, tp=tp, ep=ep, etp=tp)
        if t.buffer:
            nbytes += 4 * n
            continue
        elements += n
        nbytes += _quantized_bytes(t, n, m, weights) if t.quantized else ACTIVATION_BYTES * n
    vocab = math.ceil(padded_vocab(m, VLLM, tp) / tp) * m.hidden_size * num_vocab_tensors
    return elements + vocab, nbytes + ACTIVATION_BYTES * vocab


def resolve_weights_dtype(m: ModelShape, layout: TeacherLayout, device: Device | None) -> tuple[str, list[str]]:
    """The weight format the engine serves and notes on the choice."""
    if layout.weights_dtype != "auto":
        if layout.weights_dtype == "fp8" and device is not None and not device.supports_fp8:
            raise ValueError(f"{device.name} has no FP8 matmuls; serve bf16 or int8 weights")
        return layout.weights_dtype, []
    if m.fp8_block is None:
        return "bf16", []
    if device is None or device.supports_fp8:
        return "fp8", []
    return "bf16", [
        f"the FP8 checkpoint is served in bf16 on {device.name} (no FP8 matmuls); "
        "weights_dtype=int8 plans a W8A8 quantisation instead"
    ]


def _kv_bytes_per_token(m: ModelShape, layout: TeacherLayout, num_layers: int) -> int:
    kv_bytes = 1 if layout.kv_cache_dtype == "fp8" else 2
    if m.attention == "mla":
        per_layer = m.kv_cache_elements_per_token_per_layer
    else:
        heads = max(1, m.num_key_value_heads // layout.tensor_parallel_size)
        per_layer = 2 * heads * m.head_dim
    return per_layer * num_layers * kv_bytes


def _workspace(m: ModelShape, layout: TeacherLayout, last_stage: bool) -> int:
    """Activations of one engine step of ``max_num_batched_tokens`` tokens (plus logits when last)."""
    tokens, tp = layout.max_num_batched_tokens, layout.tensor_parallel_size
    if m.is_moe:
        split = tp * layout.data_parallel_size if layout.enable_expert_parallel else tp
        mlp = max(m.moe_router_topk * 3 * m.moe_ffn_hidden_size / split, 3 * m.ffn_hidden_size / tp)
    else:
        mlp = 3 * m.ffn_hidden_size / tp
    # Residual stream, norm output, attention output, qkv projections: a few hidden-sized tensors.
    qkv = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim / tp
    nbytes = tokens * ACTIVATION_BYTES * (4 * m.hidden_size + qkv + mlp)
    if last_stage:
        # bf16 logits, their float32 copy and the float32 log-softmax of every scored token.
        nbytes += tokens * padded_vocab(m, VLLM, tp) * (2 + 4 + 4)
    return int(nbytes)


def plan_teacher(
    hf_config: dict,
    layout: TeacherLayout,
    batch: Batch,
    device: Device | None = None,
    *,
    min_concurrent_sequences: int = 1,
) -> TeacherPlan:
    """Per-stage device memory of a vLLM engine scoring ``batch.seq_length``-token samples.

    Args:
        hf_config: the teacher's HF ``config.json`` dict.
        layout: vLLM's parallel sizes and memory settings.
        batch: sequence length (the engine's ``max_model_len``) and top-k.
        device: when given, the plan says whether it fits (``problems``) and how much KV cache remains.
        min_concurrent_sequences: full-length sequences whose KV cache must fit at once (vLLM refuses
            to start when not even one does; more keep the teacher busy).

    Raises:
        ValueError: the model does not split over the layout.
    """
    m = model_shape(hf_config)
    _check_splits(m, layout)
    weights, notes = resolve_weights_dtype(m, layout, device)
    pp = layout.pipeline_parallel_size
    ranks = []
    for pp_rank, layers in enumerate(vllm_stage_layers(m.num_layers, pp)):
        elements, weight_bytes = _weights(m, layout, weights, pp_rank, layers)
        last = pp_rank == pp - 1
        kv_per_token = _kv_bytes_per_token(m, layout, len(layers))
        memory = MemoryBreakdown(
            weights=weight_bytes,
            kv_cache=kv_per_token * batch.seq_length * min_concurrent_sequences,
            workspace=_workspace(m, layout, last),
            teacher_topk=layout.max_num_batched_tokens * batch.top_k * (8 + 4) if last else 0,
        )
        rank = TeacherRank(
            pp_rank=pp_rank, num_layers=len(layers), parameters=elements, memory=memory, kv_bytes_per_token=kv_per_token
        )
        if device is not None:
            # vLLM's share of the device, less what the runtime holds outside torch's allocator.
            reserve = device.memory_bytes - device.usable_bytes
            budget = int(device.memory_bytes * layout.gpu_memory_utilization) - reserve
            spare = budget - (memory.total - memory.kv_cache)
            rank.kv_capacity_tokens = max(0, spare // kv_per_token) if kv_per_token else None
            if memory.total > budget:
                rank.problem = (
                    f"stage {pp_rank}: weights {_gib(memory.weights)} + step workspace {_gib(memory.workspace)} + "
                    f"KV for {min_concurrent_sequences} x {batch.seq_length} tokens {_gib(memory.kv_cache)} = "
                    f"{_gib(memory.total)} GiB > {_gib(budget)} GiB budget"
                )
        ranks.append(rank)
    if m.num_mtp_layers:
        notes.append(f"{m.num_mtp_layers} MTP layer(s) not loaded (vLLM loads them only for speculative decoding)")
    return TeacherPlan(
        architecture=m.architecture,
        layout=layout,
        counts=count_parameters(m),
        weights_dtype=weights,
        ranks=ranks,
        notes=notes,
        device=device,
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}"
