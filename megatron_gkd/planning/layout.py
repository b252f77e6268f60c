"""Plain inputs of the planner: the student's Megatron layout, the batch, the teacher's vLLM layout.

Field names follow Megatron-Core and vLLM, so a trainer config maps onto them one to one. Nothing here
imports torch: a plan is computed on a laptop.
"""

from __future__ import annotations

import dataclasses

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""The trainer's (torch's) dtype names -> the planner's."""
KERNELS = ("fused", "local")
RECOMPUTE = (None, "selective", "full")
LOSSES = ("distill", "fused_distill", "cross_entropy")
TEACHER_WEIGHTS = ("auto", "bf16", "fp8", "int8")


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(kw_only=True)
class StudentLayout:
    """How the student is split over devices and what its training keeps in memory."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B)."""
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert; ``None``: the same as ``tensor_model_parallel_size``."""
    data_parallel_size: int = 1
    sequence_parallel: bool = False
    params_dtype: str = "bf16"
    """Parameter dtype: ``fp32``, ``bf16``, ``fp16`` or ``fp8`` (FP8 primary weights; the optimizer
    keeps float32 main parameters as for bf16)."""
    grad_reduce_in_fp32: bool = True
    """Megatron's gradient buffer in float32 (its default for bf16 training)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (and float32 main parameters) over data-parallel ranks."""
    recompute_granularity: str | None = None
    """``None``, ``selective`` (core attention) or ``full`` (whole layers, ``recompute_method``)."""
    recompute_method: str = "uniform"
    """``uniform``: checkpoint groups of ``recompute_num_layers`` layers; ``block``: checkpoint the first
    ``recompute_num_layers`` layers of each pipeline chunk and keep the rest."""
    recompute_num_layers: int = 1
    kernels: str = "fused"
    """``fused``: Transformer Engine / MindSpeed kernels (flash attention, fused norm + linear, fused
    SwiGLU), what accelerators run. ``local``: Megatron's local layer spec (unfused attention with the
    score matrix, torch norms), what runs on the CPU."""
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    include_mtp: bool = False
    """Train the multi-token-prediction layers too (on the last stage); ``megatron_gkd.models`` skips them."""
    moe_imbalance: float = 1.0
    """Tokens the busiest expert-parallel rank receives, relative to a perfectly balanced router."""

    def __post_init__(self):
        _positive(
            "student",
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            data_parallel_size=self.data_parallel_size,
            recompute_num_layers=self.recompute_num_layers,
        )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size == 1:
            raise ValueError("student.virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1")
        if self.params_dtype not in DTYPE_BYTES:
            raise ValueError(f"student.params_dtype={self.params_dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"student.kernels={self.kernels!r}; choose one of {list(KERNELS)}")
        if self.recompute_granularity not in RECOMPUTE:
            raise ValueError(
                f"student.recompute_granularity={self.recompute_granularity!r}; choose one of {list(RECOMPUTE)}"
            )
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"student.recompute_method={self.recompute_method!r}; choose 'uniform' or 'block'")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("student.sequence_parallel needs tensor_model_parallel_size > 1; set it false")
        if self.moe_imbalance < 1.0:
            raise ValueError(f"student.moe_imbalance={self.moe_imbalance} must be >= 1 (1 = balanced routing)")

    @classmethod
    def from_parallel_sizes(cls, sizes: dict, world_size: int, **fields) -> "StudentLayout":
        """The layout of ``megatron_gkd.parallel.initialize(**sizes)`` on ``world_size`` ranks.

        ``sizes`` uses Megatron's names (``ParallelConfig`` fields, absent ones at their defaults);
        ``fields`` sets the rest (dtype, optimizer sharding, recomputation, kernels).
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(sizes) - known
        if unknown:
            raise ValueError(f"unknown parallel sizes {sorted(unknown)}; expected StudentLayout fields")
        model_parallel = sizes.get("tensor_model_parallel_size", 1) * sizes.get("pipeline_model_parallel_size", 1)
        return cls(**sizes, data_parallel_size=world_size // model_parallel, **fields)

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks that hold the same experts (the distributed optimizer shards expert state over them)."""
        expert_ranks = self.etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % expert_ranks:
            raise ValueError(
                f"world size {self.world_size} (TP x PP x DP) is not divisible by expert_tensor_parallel_size "
                f"x expert_model_parallel_size x pipeline_model_parallel_size = {expert_ranks}; "
                "raise data_parallel_size or lower expert_model_parallel_size"
            )
        return self.world_size // expert_ranks

    def describe(self) -> str:
        parts = [
            f"TP{self.tensor_model_parallel_size}",
            f"PP{self.pipeline_model_parallel_size}",
        ]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.expert_model_parallel_size > 1:
            parts.append(f"EP{self.expert_model_parallel_size}")
        if self.etp != self.tensor_model_parallel_size:
            parts.append(f"ETP{self.etp}")
        parts.append(f"DP{self.data_parallel_size}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.use_distributed_optimizer:
            parts.append("distopt")
        if self.recompute_granularity:
            parts.append(f"recompute={self.recompute_granularity}")
        return " ".join(parts)


@dataclasses.dataclass(kw_only=True)
class Batch:
    """What one training step pushes through the student, and the teacher's top-k size."""

    seq_length: int
    """Tokens per sample (prompt + response), the padded length of a micro-batch."""
    micro_batch_size: int = 1
    num_microbatches: int = 1
    """Micro-batches per step on each data-parallel rank."""
    top_k: int = 64
    """Teacher log-probs per response token."""
    loss: str = "distill"
    """``distill`` (vocab-parallel divergence on the ``[s, b, v/tp]`` logits), ``fused_distill`` (chunked:
    logits never held whole) or ``cross_entropy`` (Megatron's own loss, as in the CPU memory check)."""
    chunk_size: int = 1024
    """Tokens per chunk of a chunked loss (``loss.chunk_size``); sizes the hidden-signal loss's buffers."""

    def __post_init__(self):
        _positive(
            "batch",
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            num_microbatches=self.num_microbatches,
            top_k=self.top_k,
            chunk_size=self.chunk_size,
        )
        if self.loss not in LOSSES:
            raise ValueError(f"batch.loss={self.loss!r}; choose one of {list(LOSSES)}")


@dataclasses.dataclass(kw_only=True)
class WeightSync:
    """The weight-sync buckets a trainer rank holds (``megatron_gkd.weight_sync`` defaults)."""

    bucket_size_mb: float = 512.0
    num_buffers: int = 2
    transfer: str = "packed"
    """``packed``: ``num_buffers`` buckets per side; ``direct``: the receiver's arena is the whole model."""

    def __post_init__(self):
        if self.bucket_size_mb <= 0 or self.num_buffers < 1:
            raise ValueError("weight_sync.bucket_size_mb must be positive and num_buffers >= 1")
        if self.transfer not in ("packed", "direct"):
            raise ValueError(f"weight_sync.transfer={self.transfer!r}; choose 'packed' or 'direct'")


@dataclasses.dataclass(kw_only=True)
class TeacherLayout:
    """A vLLM teacher engine: its parallel sizes and memory settings."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    """vLLM's expert parallelism: experts split over all TP x DP ranks instead of being TP-split."""
    weights_dtype: str = "auto"
    """``auto`` (the checkpoint's: FP8 for DeepSeek-V3 as released, else bf16; bf16 on devices without
    FP8), ``bf16``, ``fp8`` (128 x 128 block scales) or ``int8`` (W8A8 with per-channel scales, how
    Ascend serves DeepSeek-V3)."""
    kv_cache_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    """Tokens per engine step (chunked prefill): sizes the logits workspace of prompt log-probs."""

    def __post_init__(self):
        _positive(
            "teacher",
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        if self.weights_dtype not in TEACHER_WEIGHTS:
            raise ValueError(f"teacher.weights_dtype={self.weights_dtype!r}; choose one of {list(TEACHER_WEIGHTS)}")
        if self.kv_cache_dtype not in ("bf16", "fp8"):
            raise ValueError(f"teacher.kv_cache_dtype={self.kv_cache_dtype!r}; choose bf16 or fp8")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"teacher.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def describe(self) -> str:
        text = f"TP{self.tensor_parallel_size} PP{self.pipeline_parallel_size}"
        if self.data_parallel_size > 1:
            text += f" DP{self.data_parallel_size}"
        if self.enable_expert_parallel:
            text += " EP"
        return text
