"""Measured training memory of tiny HF-architecture models under Megatron-Core on the CPU.

The ground truth for the planner's memory model (``megatron_gkd.planning``): each rank builds the
model of a tiny config with ``megatron_gkd.models.build_model`` (local layer spec, float32), wraps it
in Megatron's ``DistributedDataParallel`` (float32 gradient buffer), builds Megatron's Adam and trains
a few steps with the pipeline schedules under :class:`~megatron_gkd.testing.memory.LiveTensorPeak`.
Run :func:`measure_training` on every rank through ``run_distributed``.
"""

from __future__ import annotations

import dataclasses

from megatron_gkd import models, parallel
from megatron_gkd.planning import Batch, StudentLayout, plan_student
from megatron_gkd.testing import mcore
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import TINY_CONFIGS
from megatron_gkd.testing.memory import LiveTensorPeak

STEP_REGION = "planner_memory.train_step"


# Qwen3-0.6B's shape (its config.json; random weights): 28 layers, 1024 wide, 16 query and 8 key-value heads of
# 128, SwiGLU 3072, a 151,936-row tied table: 596M parameters.
QWEN3_0_6B_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151_936, tie_word_embeddings=True,
                        max_position_embeddings=40_960, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0))


def tiny_hf_config(architecture: str, **overrides) -> dict:
    """``TINY_CONFIGS[architecture]`` as a ``config.json`` dict (``architectures`` set), ``overrides`` applied."""
    return {**TINY_CONFIGS[architecture], "architectures": [architecture], **overrides}


def _wrap_ddp(chunks: list, use_distributed_optimizer: bool) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    return [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def measure_training(
    hf_config: dict,
    parallel_sizes: dict,
    *,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    num_steps: int = 2,
    use_distributed_optimizer: bool = False,
    bf16: bool = False,
    config_overrides: dict | None = None,
) -> dict:
    """Trains ``num_steps`` steps on this rank; returns its coordinates, parameter counts and peak.

    ``bf16`` builds bf16 parameters (float32 main parameters in the optimizer); ``config_overrides``
    go to the ``TransformerConfig`` (e.g. ``recompute_granularity="full"``).

    Returns:
        ``pp_rank``, ``tp_rank``, ``ep_rank``, ``parameters`` (elements of this rank's parameters),
        ``buffers`` (elements of persistent buffers that are model state, e.g. the router bias),
        ``peak_bytes`` (the largest live tensor bytes during the training steps, counted from before
        the model was built) and ``max_rss_bytes`` (the process's peak resident set, libraries, allocator
        caches and the profiler's records included).
    """
    import resource

    state = parallel.initialize(**parallel_sizes)
    try:
        spec = mcore.TinyGPTSpec(
            vocab_size=hf_config["vocab_size"],
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            num_microbatches=num_microbatches,
            use_distributed_optimizer=use_distributed_optimizer,
            bf16=bf16,
        )
        with LiveTensorPeak() as meter:
            model = models.build_model(hf_config, dtype=spec.params_dtype, **(config_overrides or {}))
            chunks = _wrap_ddp(model, use_distributed_optimizer)
            optimizer = mcore.build_optimizer(spec, chunks)
            for microbatches in mcore.synthetic_batches(spec, num_steps):
                with meter.region(STEP_REGION):
                    mcore.train_step(spec, chunks, optimizer, microbatches)
        modules = [models.unwrap(chunk) for chunk in chunks]
        return dict(
            pp_rank=state.pp_rank,
            tp_rank=state.tp_rank,
            ep_rank=state.ep_rank,
            parameters=sum(p.numel() for module in modules for p in module.parameters()),
            buffers=sum(b.numel() for module in modules for name, b in module.named_buffers() if "expert_bias" in name),
            peak_bytes=meter.peak(STEP_REGION),
            max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        )
    finally:
        parallel.destroy()


def count_model_parameters(hf_config: dict, parallel_sizes: dict) -> dict:
    """This rank's parameter and state-buffer elements of a freshly built model (no training)."""
    state = parallel.initialize(**parallel_sizes)
    try:
        chunks = models.build_model(hf_config)
        return dict(
            pp_rank=state.pp_rank,
            parameters=sum(p.numel() for chunk in chunks for p in chunk.parameters()),
            buffers=sum(b.numel() for chunk in chunks for n, b in chunk.named_buffers() if "expert_bias" in n),
        )
    finally:
        parallel.destroy()


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """One measured layout: a tiny architecture, its parallel sizes, world size and batch shape."""

    name: str
    architecture: str
    world_size: int
    parallel_sizes: dict = dataclasses.field(default_factory=dict)
    seq_length: int = 128
    micro_batch_size: int = 2
    num_microbatches: int = 4
    use_distributed_optimizer: bool = False
    bf16: bool = False
    recompute: dict = dataclasses.field(default_factory=dict)
    """``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` for Megatron."""
    hf_overrides: dict = dataclasses.field(default_factory=dict)
    """Changes to the tiny config (a real model's shape: ``QWEN3_0_6B_SHAPE``)."""
    num_steps: int = 2

    @property
    def hf_config(self) -> dict:
        return tiny_hf_config(self.architecture, **self.hf_overrides)

    def measure(self) -> list[dict]:
        """Runs the case on ``world_size`` ranks (call from the parent process)."""
        return run_distributed(
            measure_training,
            self.world_size,
            args=(self.hf_config, self.parallel_sizes),
            kwargs=dict(
                num_steps=self.num_steps,
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
                num_microbatches=self.num_microbatches,
                use_distributed_optimizer=self.use_distributed_optimizer,
                bf16=self.bf16,
                config_overrides=self.recompute,
            ),
            timeout=900,
        )

    def plan(self):
        """The planner's :class:`~megatron_gkd.planning.StudentPlan` for this case (local kernels, CE loss)."""
        layout = StudentLayout.from_parallel_sizes(
            self.parallel_sizes,
            self.world_size,
            params_dtype="bf16" if self.bf16 else "fp32",
            use_distributed_optimizer=self.use_distributed_optimizer,
            recompute_granularity=self.recompute.get("recompute_granularity"),
            recompute_method=self.recompute.get("recompute_method") or "uniform",
            recompute_num_layers=self.recompute.get("recompute_num_layers") or 1,
            kernels="local",
        )
        batch = Batch(
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            num_microbatches=self.num_microbatches,
            loss="cross_entropy",
        )
        return plan_student(self.hf_config, layout, batch)


def compare(case: MemoryCase, measured: list[dict]) -> list[dict]:
    """Per rank: measured peak, predicted total and their ratio (predicted / measured)."""
    plan = case.plan()
    rows = []
    for rank, result in enumerate(measured):
        predicted = plan.ranks[result["pp_rank"]].memory.total
        rows.append(
            dict(
                case=case.name,
                rank=rank,
                pp_rank=result["pp_rank"],
                measured_bytes=result["peak_bytes"],
                predicted_bytes=predicted,
                ratio=predicted / result["peak_bytes"],
                max_rss_bytes=result.get("max_rss_bytes"),
            )
        )
    return rows
