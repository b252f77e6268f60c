"""``--dry-run``: the validated config's rank and batch plan, computed without starting anything."""

from __future__ import annotations

from megatron_gkd import planning
from megatron_gkd.config.checkpoints import check_checkpoints
from megatron_gkd.config.checks import check_layout, eval_enabled, generating_teacher, needs_rollout, needs_teacher
from megatron_gkd.config.schema import GKDConfig
from megatron_gkd.rollout.registry import engine_traits
from megatron_gkd.teacher.clients import client_traits


def rank_coordinates(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """``(tp_rank, dp_rank, pp_rank)`` of ``rank`` in Megatron's default order (tp fastest, then dp, then pp)."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def _teacher_head_text(config: GKDConfig) -> str:
    """The teacher's output-layer shard per student rank, or why the configs at hand cannot say."""
    try:
        head = planning.teacher_head.plan_teacher_head_from_checkpoints(
            config.student.checkpoint, config.teacher.head_source,
            tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
            params_dtype=planning.layout.DTYPE_NAMES[config.student.dtype], chunk_size=config.loss.chunk_size)
    except ValueError as error:
        return f"no plan: {error}"
    return head.describe()


def _self_weights_text(teacher) -> str:
    """What a self teacher reads: the student's current or initial weights, or their EMA (with its memory)."""
    if teacher.self_weights == "ema":
        return (f"an EMA of the student's weights (decay {teacher.ema_decay}, float32, one more copy of the student's "
                "parameters per rank)")
    return f"the student's {teacher.self_weights or 'current'} weights"


def layout_plan(config: GKDConfig, world_size: int | None = None) -> str:
    """A human-readable plan: layout, ranks and their roles, batch split, rollout and teacher.

    Raises:
        ValueError: the layout does not fit ``world_size`` or the batch does not split, or a checkpoint does not fit
            the layout (:func:`~megatron_gkd.config.checkpoints.check_checkpoints`).
    """
    parallel, trainer, rollout = config.parallel, config.trainer, config.rollout
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    world_size = world_size or tp * pp
    plan = check_layout(config, world_size)
    checkpoints = check_checkpoints(config, world_size)
    dp = plan["data_parallel_size"]
    lines = [
        f"mode {trainer.mode}, scheduler {trainer.scheduler}, {trainer.num_steps} steps, output {trainer.output_dir}",
        f"world {world_size} = tp {tp} x pp {pp} x dp {dp} (vpp {parallel.virtual_pipeline_model_parallel_size or 1}, "
        f"ep {parallel.expert_model_parallel_size}, sequence parallel {parallel.sequence_parallel})",
        f"batch: {trainer.global_batch_size} samples = {plan['prompts_per_step']} prompts x "
        f"{rollout.n if trainer.run_mode.samples else 1}; {plan['samples_per_rank']} samples per data-parallel rank, "
        + (f"micro-batches of <= {trainer.max_tokens_per_microbatch} tokens" if trainer.max_tokens_per_microbatch
           else f"{plan['samples_per_rank'] // trainer.micro_batch_size} micro-batches of {trainer.micro_batch_size}"),
        f"loss: {config.loss.type if trainer.run_mode.distills else 'cross_entropy'}"
        + (" (fused)" if config.loss.fused else "")
        + (f", confidence_alpha {config.loss.confidence_alpha}" if config.loss.confidence_alpha is not None else ""),
    ]
    if needs_rollout(config):
        where = (f"colocated, {rollout.engine} TP {rollout.tensor_parallel_size} x {plan['rollout_replicas']} replica(s)"
                 if rollout.layout.in_trainer and not engine_traits(rollout.engine).shares_student_weights
                 else f"{rollout.layout} {rollout.engine}")
        lines.append(f"rollout: {where}, n {rollout.n}, max_tokens {rollout.max_tokens}, weight sync "
                     f"{config.weight_sync.transport}")
    mix = config.sample_mix
    if mix.enabled:
        schedule = {"constant": "constant", "linear": f"linear to {mix.lmbda_end} over {mix.ramp_steps} steps from step "
                    f"{mix.ramp_start}", "step": f"steps {list(mix.milestones)} -> {list(mix.values)}"}[mix.schedule]
        written = (f"written by teacher {generating_teacher(config)!r} ({rollout.n} a prompt, temperature "
                   f"{mix.teacher.temperature})" if mix.source_traits.teacher_writes else "the records' own (one a prompt)")
        lines.append(f"GKD's mixture: lmbda {mix.lmbda} ({schedule}) student samples, drawn per {mix.per}; otherwise "
                     f"responses {written}")
    if needs_teacher(config) or eval_enabled(config) and config.teacher.enabled:
        teacher = config.teacher
        where = (f"service started on loopback ({teacher.serve.backend} backend, {teacher.serve.model})"
                 if teacher.serve.model else
                 f"{_self_weights_text(teacher)} on {teacher.privileged_template!r}"
                 if client_traits(teacher.client).reads_student else
                 teacher.address or teacher.base_url or teacher.checkpoint)
        lines.append(f"teacher: {teacher.client} client, {where}, "
                     + (f"top-k {teacher.top_k}" if teacher.signal.sends_topk else f"{teacher.signal} signal"))
        if teacher.signal.needs_head:
            lines.append(f"teacher head (hidden signal): {_teacher_head_text(config)}")
    lines += checkpoints
    lines.append("ranks (tp, dp, pp):")
    for rank in range(world_size):
        tp_rank, dp_rank, pp_rank = rank_coordinates(rank, tp, dp)
        roles = []
        if pp_rank == pp - 1:
            roles.append("loss")
            if tp_rank == 0 and needs_teacher(config) and not client_traits(config.teacher.client).collective:
                roles.append("teacher requests")
        if rank == 0:
            roles.append("logging")
        lines.append(f"  rank {rank}: tp {tp_rank} dp {dp_rank} pp {pp_rank}" + (f"  [{', '.join(roles)}]" if roles else ""))
    return "\n".join(lines)
