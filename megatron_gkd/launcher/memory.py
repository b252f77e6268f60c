"""Per-device memory plans of a job's layouts, from the trainer config and the planner
(:mod:`megatron_gkd.planning`): what a dry run prints, and how it picks a vLLM teacher layout."""

from __future__ import annotations

import dataclasses

from megatron_gkd import planning
from megatron_gkd.config.checks import check_layout

_DTYPES = planning.layout.DTYPE_NAMES
_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                   "expert_tensor_parallel_size", "sequence_parallel")


def planning_batch(config) -> planning.Batch:
    """The batch one training step pushes through a device: the longest prompt + response, the trainer's
    micro-batches per data-parallel rank (at world size 1: an upper bound), the teacher's top-k."""
    trainer, rollout = config.trainer, config.rollout
    seq_length = min(config.data.max_prompt_length + rollout.max_tokens, rollout.max_model_len)
    micro_batch = trainer.micro_batch_size
    if trainer.max_tokens_per_microbatch:
        seq_length, micro_batch = trainer.max_tokens_per_microbatch, 1
    loss = "cross_entropy" if not trainer.run_mode.distills else "fused_distill" if config.loss.fused else "distill"
    return planning.Batch(seq_length=seq_length, micro_batch_size=micro_batch,
                          num_microbatches=max(1, trainer.global_batch_size // micro_batch),
                          top_k=config.teacher.top_k, loss=loss, chunk_size=config.loss.chunk_size)


def _read(path: str | None, what: str) -> dict:
    if not path:
        raise ValueError(f"no {what} checkpoint in the config")
    try:
        return planning.read_config(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the {what}'s config.json ({error})") from None


def teacher_head(config) -> planning.TeacherHeadShape | None:
    """The teacher's output layer the student holds with ``teacher.signal=hidden`` (``None``: top-k).

    Raises:
        ValueError: the head checkpoint's ``config.json`` cannot be read.
    """
    if not config.teacher.signal.needs_head or not config.teacher.enabled:
        return None
    return planning.TeacherHeadShape.from_config(_read(config.teacher.head_source, "teacher head"))


def student_plan(config, world_size: int, kernels: str) -> planning.StudentPlan:
    """The planner's per-stage memory of the config's student layout on ``world_size`` ranks.

    Raises:
        ValueError: the student's ``config.json`` cannot be read, or the layout does not split it.
    """
    hf = _read(config.student.checkpoint, "student")
    plan = check_layout(config, world_size)
    sizes = {name: getattr(config.parallel, name) for name in _PARALLEL_SIZES}
    layout = planning.StudentLayout.from_parallel_sizes(
        sizes, world_size, params_dtype=_DTYPES[config.student.dtype],
        use_distributed_optimizer=config.optim.use_distributed_optimizer,
        recompute_granularity=config.student.recompute.megatron_options.get("recompute_granularity"),
        kernels=kernels)
    batch = planning_batch(config)
    batch = dataclasses.replace(batch, num_microbatches=max(1, plan["samples_per_rank"] // batch.micro_batch_size))
    sync = config.weight_sync
    weight_sync = planning.WeightSync(bucket_size_mb=sync.bucket_size_mb, num_buffers=sync.num_buffers,
                                      transfer="direct" if sync.transfer == "direct" else "packed")
    return planning.plan_student(hf, layout, batch, weight_sync, teacher_head=teacher_head(config))


def student_plan_text(config, world_size: int, device: planning.Device | None, kernels: str) -> str:
    """The student table, and whether its fullest rank fits ``device``; a note when no plan can be made."""
    try:
        plan = student_plan(config, world_size, kernels)
    except ValueError as error:
        return f"student: no memory plan: {error}"
    text = planning.student_table(plan)
    if device is not None:
        peak, usable = plan.peak.memory.total, device.usable_bytes
        verdict = "fits" if peak <= usable else "DOES NOT FIT"
        text += (f"\n  fullest rank {peak / 2**30:.2f} GiB of {usable / 2**30:.2f} GiB usable on {device.name}: "
                 f"{verdict}")
    return text


def teacher_layout_from_args(backend_args: dict) -> planning.TeacherLayout:
    """The planner's view of a vLLM teacher's ``backend_args``."""
    names = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
             "gpu_memory_utilization", "max_num_batched_tokens"}
    fields = {name: backend_args[name] for name in names if name in backend_args}
    if backend_args.get("kv_cache_dtype", "auto").startswith("fp8"):
        fields["kv_cache_dtype"] = "fp8"
    return planning.TeacherLayout(**fields)


def teacher_plan_text(model: str, layout: planning.TeacherLayout, batch: planning.Batch,
                      device: planning.Device | None) -> str:
    """The vLLM teacher table for ``layout``; a note when the model's config cannot be read."""
    try:
        plan = planning.plan_teacher(_read(model, "teacher"), layout, batch, device)
    except ValueError as error:
        return f"teacher: no memory plan: {error}"
    text = planning.teacher_table(plan)
    for problem in plan.problems:
        text += f"\n  DOES NOT FIT: {problem}"
    return text


def choose_teacher_layout(config, num_nodes: int, nproc_per_node: int,
                          device: planning.Device) -> tuple[planning.TeacherLayout, str]:
    """The smallest vLLM layout of the config's teacher on ``num_nodes`` x ``nproc_per_node`` devices that the
    planner finds to fit, and the planner's text (the layouts that fail and why).

    Raises:
        ValueError: a config cannot be read, or no layout fits (the message has the planner's reasons).
    """
    teacher_hf = _read(config.teacher.serve.model, "teacher")
    student_hf = _read(config.student.checkpoint, "student")
    base = teacher_layout_from_args(config.teacher.serve.backend_args)
    cluster = planning.Cluster(nodes=num_nodes, devices_per_node=nproc_per_node, device=device)
    proposal = planning.propose(student_hf, cluster, planning_batch(config), teacher_hf=teacher_hf, teacher_base=base,
                                teacher_head=teacher_head(config))
    rejected = [f"  {item.layout}: {item.reason}" for item in proposal.teacher_rejected]
    if len(rejected) > 6:
        rejected = rejected[:6] + [f"  ... {len(rejected) - 6} more (python -m megatron_gkd.planning propose lists all)"]
    if proposal.teacher is None:
        raise ValueError(f"no vLLM layout of the teacher fits {cluster.describe()}:\n" + "\n".join(rejected))
    text = [f"cluster: {cluster.describe()}", planning.teacher_table(proposal.teacher)]
    if rejected:
        text += [f"smaller layouts that fail ({len(proposal.teacher_rejected)}):", *rejected]
    return proposal.teacher.layout, "\n".join(text)
