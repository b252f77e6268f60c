"""Per-device memory of the student's Megatron-Core training: one row per pipeline stage.

Every rank of a stage holds the same amount (tensor-, expert- and data-parallel ranks hold equal
shards), so a plan has one :class:`RankMemory` per pipeline rank. Bytes per parameter follow
Megatron's accounting (Korthikanti et al., and the distributed-optimizer notes of Megatron-LM):
weights in ``params_dtype``, the gradient buffer in float32 (``grad_reduce_in_fp32``), Adam's two
moments and, for half-precision weights, float32 main parameters; the distributed optimizer divides
the optimizer part by the data-parallel size (expert parameters: by the expert-data-parallel size).
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_gkd.planning import activations as acts
from megatron_gkd.planning.layout import DTYPE_BYTES, Batch, StudentLayout, WeightSync
from megatron_gkd.planning.model import ModelShape, model_shape
from megatron_gkd.planning.params import (
    MEGATRON,
    ParameterCounts,
    count_parameters,
    embedding_tensor,
    layer_tensors,
    mtp_tensors,
    output_tensors,
    shard_elements,
)
from megatron_gkd.planning.splits import check_layers, check_split
from megatron_gkd.planning.teacher_head import (
    TEACHER_HIDDEN_BYTES,
    TeacherHeadPlan,
    TeacherHeadShape,
    plan_teacher_head,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class MemoryBreakdown:
    """Bytes on one device, by what holds them."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    """Saved activations of the micro-batches in flight (pipeline schedule) on this stage."""
    backward_workspace: int = 0
    """The largest transient of the backward pass: recomputed layers and activation gradients."""
    teacher_topk: int = 0
    """Teacher top-k ids (int64) and log-probs (float32) of this rank's step (last stage only)."""
    teacher_hidden: int = 0
    """Hidden signal: the teacher's hidden states (float32) and token log-probs of this rank's step
    (last stage only); replaces ``teacher_topk``."""
    teacher_head: int = 0
    """Hidden signal: the teacher's output-layer shard ``[V/tp, h_teacher]`` (last stage only); frozen,
    so it has no gradient or optimizer state."""
    hidden_loss: int = 0
    """Hidden signal: the loss's float32 chunk buffers (an estimate, see ``planning.teacher_head``)."""
    weight_sync: int = 0
    """Weight-sync bucket buffers of a sending rank."""
    kv_cache: int = 0
    """vLLM only: the KV cache the plan needs."""
    workspace: int = 0
    """vLLM only: activations of one engine step and the prompt-log-prob logits."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass(kw_only=True)
class RankMemory:
    """One pipeline stage's device."""

    pp_rank: int
    num_layers: int
    num_moe_layers: int
    parameters: int
    """Parameter elements on the device (this rank's shards)."""
    expert_parameters: int
    buffers: int
    """State elements that are not parameters (the router's score-correction bias)."""
    memory: MemoryBreakdown


@dataclasses.dataclass(kw_only=True)
class StudentPlan:
    architecture: str
    layout: StudentLayout
    batch: Batch
    counts: ParameterCounts
    ranks: list[RankMemory]
    notes: list[str]
    teacher_head: TeacherHeadPlan | None = None
    """The teacher head shard of the hidden signal (``None``: the top-k signal)."""

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda rank: rank.memory.total)


def stage_layers(num_layers: int, layout: StudentLayout) -> list[list[list[int]]]:
    """Global layer indices per ``[pp rank][vpp chunk]``, as Megatron-Core assigns them.

    Raises:
        ValueError: the layers do not split (the message names the fix).
    """
    pp, vpp = layout.pipeline_model_parallel_size, layout.vpp
    first, last = layout.num_layers_in_first_pipeline_stage, layout.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        check_layers(num_layers, pp, vpp)
        per_chunk = num_layers // (pp * vpp)
        return [
            [list(range((c * pp + r) * per_chunk, (c * pp + r + 1) * per_chunk)) for c in range(vpp)]
            for r in range(pp)
        ]
    if vpp > 1 or pp < 2:
        raise ValueError("num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1 and no VPP")
    counts = [None] * pp
    counts[0], counts[-1] = first, last
    middle = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - sum(c for c in counts if c is not None)
    if rest < 0 or (middle and rest % len(middle)) or (not middle and rest):
        raise ValueError(
            f"num_layers_in_first/last_pipeline_stage ({first}, {last}) leave {rest} of {num_layers} layers "
            f"for {len(middle)} middle stage(s); they must split evenly"
        )
    for i in middle:
        counts[i] = rest // len(middle)
    starts = [sum(counts[:i]) for i in range(pp)]
    return [[list(range(starts[r], starts[r] + counts[r]))] for r in range(pp)]


def in_flight_microbatches(pp_rank: int, layout: StudentLayout, num_microbatches: int) -> int:
    """Micro-batch *chunks* whose activations a stage holds at once under Megatron's 1F1B schedules.

    Non-interleaved: ``pp - rank - 1`` warm-up forwards plus one. Interleaved: Megatron's warm-up count
    ``(pp - rank - 1) * 2 + (vpp - 1) * pp`` plus one, each holding one chunk's layers.
    """
    pp, vpp = layout.pipeline_model_parallel_size, layout.vpp
    if pp == 1:
        return 1
    if vpp == 1:
        return min(pp - pp_rank, num_microbatches)
    return min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1, num_microbatches * vpp)


def _context(layout: StudentLayout, batch: Batch) -> acts.Context:
    act_bytes = 4 if layout.params_dtype == "fp32" else 2
    return acts.Context(
        seq_length=batch.seq_length,
        act_bytes=act_bytes,
        kernels=layout.kernels,
        micro_batch_size=batch.micro_batch_size,
        selective_recompute=layout.recompute_granularity == "selective",
    )


def layer_activation_terms(m: ModelShape, layer: int, layout: StudentLayout, ctx: acts.Context) -> list[acts.Term]:
    attention = acts.mla_attention_terms(m, ctx) if m.attention == "mla" else acts.gqa_attention_terms(m, ctx)
    if not m.moe_layers[layer]:
        return attention + acts.dense_mlp_terms(m, ctx)
    routed = acts.routed_tokens_per_token(
        m,
        tp=layout.tensor_model_parallel_size,
        etp=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        imbalance=layout.moe_imbalance,
    )
    return attention + acts.moe_terms(m, ctx, routed_tokens=routed, etp=layout.etp)


def _check_splits(m: ModelShape, layout: StudentLayout) -> None:
    """The builder's own check (heads, vocabulary rows, experts; ``stage_layers`` checks the layers), and what the
    plan assumes beyond it."""
    tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
    check_split(m, tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    if ep > 1 and not m.is_moe:
        raise ValueError(f"expert_model_parallel_size={ep} splits routed experts, which {m.architecture} has none of")
    if m.is_moe and tp > 1 and not layout.sequence_parallel:
        raise ValueError("Megatron-Core needs sequence_parallel for MoE layers with tensor_model_parallel_size > 1")


def _weight_elements(m: ModelShape, layout: StudentLayout, pp_rank: int, layers: list[int]) -> tuple[int, int, int]:
    """(dense parameter elements, expert parameter elements, buffer elements) on a rank of ``pp_rank``."""
    sizes = dict(
        engine=MEGATRON,
        tp=layout.tensor_model_parallel_size,
        ep=layout.expert_model_parallel_size,
        etp=layout.etp,
    )
    pp = layout.pipeline_model_parallel_size
    tensors = [t for layer in layers for t in layer_tensors(m, m.moe_layers[layer])]
    if pp_rank == 0:
        tensors.append(embedding_tensor(m))
    if pp_rank == pp - 1:
        tensors += output_tensors(m)
        if m.tie_word_embeddings and pp > 1:
            tensors.append(embedding_tensor(m))  # the last stage's own copy of the tied output layer
        if layout.include_mtp and m.num_mtp_layers:
            tensors += mtp_tensors(m) * m.num_mtp_layers
            if pp > 1:
                tensors.append(embedding_tensor(m))  # MTP embeds the next tokens on the last stage
    dense = sum(shard_elements(t, m, **sizes) for t in tensors if not t.buffer and not t.per_expert)
    experts = sum(shard_elements(t, m, **sizes) for t in tensors if t.per_expert)
    buffers = sum(shard_elements(t, m, **sizes) for t in tensors if t.buffer)
    return dense, experts, buffers


def _state_bytes(layout: StudentLayout, dense: int, experts: int, buffers: int) -> tuple[int, int, int]:
    """(weights, gradient buffer, optimizer state) bytes."""
    weight_bytes = DTYPE_BYTES[layout.params_dtype]
    grad_bytes = 4 if layout.grad_reduce_in_fp32 else weight_bytes
    per_param_optimizer = 8 + (0 if layout.params_dtype == "fp32" else 4)  # Adam moments (+ main params)
    dense_share, expert_share = 1, 1
    if layout.use_distributed_optimizer:
        dense_share, expert_share = layout.data_parallel_size, layout.expert_data_parallel_size
    params = dense + experts
    optimizer = per_param_optimizer * (dense / dense_share + experts / expert_share)
    return params * weight_bytes + buffers * 4, params * grad_bytes, int(optimizer)


def _logits_gradient_bytes(m: ModelShape, layout: StudentLayout, batch: Batch, ctx: acts.Context) -> float:
    """The last stage's first backward transient: the gradient of the ``[s, b, v/tp]`` logits."""
    tokens = batch.seq_length * batch.micro_batch_size
    shard = m.vocab_size / layout.tensor_model_parallel_size
    if batch.loss == "distill":
        # megatron_gkd.losses writes the gradient in the logits' dtype beside the saved logits.
        return tokens * shard * ctx.act_bytes
    if batch.loss == "cross_entropy" and ctx.act_bytes < 4:
        return tokens * shard * ctx.act_bytes  # Megatron's loss reuses its softmax; the cast back copies
    return 0.0


def _activation_bytes(
    m: ModelShape, layout: StudentLayout, batch: Batch, ctx: acts.Context, pp_rank: int, chunks: list[list[int]]
) -> tuple[int, int]:
    """(saved activations of the micro-batches in flight, backward workspace) on ``pp_rank``.

    The workspace is the largest transient of the backward on top of the saved tensors: the gradient
    of the largest saved tensor and one temporary of its size (a layer's backward frees its saved
    tensors as it makes their gradients), a recomputed layer group rebuilt whole, or, on the last
    stage, the logits' gradient; plus, for the local kernels, Megatron's persistent attention-score
    buffer.
    """
    tp, sp = layout.tensor_model_parallel_size, layout.sequence_parallel
    tokens = batch.seq_length * batch.micro_batch_size
    per_layer, largest_term = [], 0.0
    for chunk in chunks:
        totals = []
        for i in chunk:
            terms = layer_activation_terms(m, i, layout, ctx)
            totals.append(tokens * acts.layer_bytes_per_token(terms, tp, sp))
            largest_term = max([largest_term] + [tokens * t.bytes_per_token(tp, sp) for t in terms])
        per_layer.append(totals)
    checkpoint = tokens * acts.checkpoint_input_bytes_per_token(m, ctx, tp, sp)
    stored_per_chunk, recomputed_group = [], 0.0
    for layers in per_layer:
        if layout.recompute_granularity != "full":
            stored_per_chunk.append(sum(layers))
            continue
        n = layout.recompute_num_layers
        if layout.recompute_method == "uniform":
            groups = [layers[i : i + n] for i in range(0, len(layers), n)]
            stored_per_chunk.append(checkpoint * len(groups))
            recomputed_group = max([recomputed_group] + [sum(g) for g in groups])
        else:  # block: the first n layers of the chunk recompute, the rest keep everything
            stored_per_chunk.append(checkpoint * min(n, len(layers)) + sum(layers[n:]))
            recomputed_group = max([recomputed_group] + layers[:n])
    # Each in-flight micro-batch holds one chunk's activations; chunks differ only by their mix of
    # dense and MoE layers, so the largest one bounds them.
    stored = max(stored_per_chunk) * in_flight_microbatches(pp_rank, layout, batch.num_microbatches)
    workspace = recomputed_group + 2 * largest_term
    if pp_rank == layout.pipeline_model_parallel_size - 1:
        stored += tokens * sum(t.bytes_per_token(tp, sp) for t in acts.final_terms(m, ctx, batch.loss))
        workspace = max(workspace, _logits_gradient_bytes(m, layout, batch, ctx))
    if layout.kernels == "local" and m.attention == "gqa":
        # Megatron's unfused attention takes its [b * a/tp, s, s] score buffer from a global buffer
        # that lives as long as the process.
        workspace += batch.micro_batch_size * m.num_attention_heads // tp * batch.seq_length**2 * ctx.act_bytes
    return int(stored), int(workspace)


def _inert_options(m: ModelShape, layout: StudentLayout) -> list[str]:
    """Options that change nothing for this model and layout (said, not silently ignored)."""
    inert = []
    custom_full = layout.recompute_method != "uniform" or layout.recompute_num_layers != 1
    if layout.recompute_granularity != "full" and custom_full:
        inert.append("recompute_method / recompute_num_layers only apply to recompute_granularity='full'")
    if layout.include_mtp and not m.num_mtp_layers:
        inert.append(f"include_mtp: {m.architecture} has no MTP layers")
    if not m.is_moe and (layout.expert_tensor_parallel_size is not None or layout.moe_imbalance != 1.0):
        inert.append(f"expert_tensor_parallel_size / moe_imbalance: {m.architecture} has no routed experts")
    return inert


def plan_student(
    hf_config: dict,
    layout: StudentLayout,
    batch: Batch,
    weight_sync: WeightSync | None = None,
    *,
    teacher_head: TeacherHeadShape | None = None,
) -> StudentPlan:
    """Per-stage device memory of training the model of ``hf_config`` with ``layout`` on ``batch``.

    Args:
        hf_config: the HF ``config.json`` as a dict.
        layout: parallel sizes, dtypes, optimizer sharding, recomputation, kernel set.
        batch: sequence length, micro-batch size and count, teacher top-k, loss.
        weight_sync: bucket settings of the trainer's weight sync (``None``: no sync, e.g. a teacher
            run through Megatron).
        teacher_head: the teacher's output layer of the hidden signal (``None``: the top-k signal). The
            last stage then holds its vocabulary shard, the loss's chunk buffers and the teacher's
            hidden states instead of its top-k.

    Raises:
        ValueError: the model does not split over the layout (the message says which size and why).
    """
    m = model_shape(hf_config)
    _check_splits(m, layout)
    ctx = _context(layout, batch)
    pp = layout.pipeline_model_parallel_size
    head = None
    if teacher_head is not None and batch.loss != "cross_entropy":
        head = plan_teacher_head(
            m.vocab_size,
            teacher_head,
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            params_dtype=layout.params_dtype,
            chunk_size=batch.chunk_size,
        )
    ranks = []
    for pp_rank, chunks in enumerate(stage_layers(m.num_layers, layout)):
        layers = [i for chunk in chunks for i in chunk]
        dense, experts, buffers = _weight_elements(m, layout, pp_rank, layers)
        weights, grads, optimizer = _state_bytes(layout, dense, experts, buffers)
        stored, workspace = _activation_bytes(m, layout, batch, ctx, pp_rank, chunks)
        memory = MemoryBreakdown(
            weights=weights, grads=grads, optimizer=optimizer, activations=stored, backward_workspace=workspace
        )
        if pp_rank == pp - 1 and batch.loss != "cross_entropy":
            tokens = batch.seq_length * batch.micro_batch_size * batch.num_microbatches
            if head is None:
                memory.teacher_topk = tokens * batch.top_k * (8 + 4)
            else:
                memory.teacher_hidden = tokens * (head.teacher.hidden_size * TEACHER_HIDDEN_BYTES + 4)
                memory.teacher_head, memory.hidden_loss = head.shard_bytes, head.loss_buffer_bytes
        if weight_sync is not None:
            memory.weight_sync = int(weight_sync.bucket_size_mb * 2**20) * weight_sync.num_buffers
        ranks.append(
            RankMemory(
                pp_rank=pp_rank,
                num_layers=len(layers),
                num_moe_layers=sum(m.moe_layers[i] for i in layers),
                parameters=dense + experts,
                expert_parameters=experts,
                buffers=buffers,
                memory=memory,
            )
        )
    notes = _inert_options(m, layout)
    for note in notes:
        logger.warning("student plan: %s", note)
    if m.num_mtp_layers and not layout.include_mtp:
        notes.append(f"{m.num_mtp_layers} MTP layer(s) not trained (include_mtp=False, as megatron_gkd.models builds)")
    return StudentPlan(
        architecture=m.architecture, layout=layout, batch=batch, counts=count_parameters(m), ranks=ranks, notes=notes,
        teacher_head=head,
    )
