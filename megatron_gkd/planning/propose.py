"""Smallest feasible teacher and student layouts for a cluster, with the reason each smaller one fails.

The teacher (one vLLM engine) gets the fewest devices that hold it: tensor parallelism inside a node
(powers of two up to the node's size), pipeline parallelism across nodes, expert parallelism tried
for MoE models; several nodes are taken whole. The student gets the devices left and the smallest
model-parallel footprint (TP x PP) that fits, preferring no recomputation to selective to full, then
the smallest expert parallelism; data parallelism takes the rest, with the distributed optimizer on.
"""

from __future__ import annotations

import dataclasses

from megatron_gkd.planning.cluster import Cluster
from megatron_gkd.planning.layout import Batch, StudentLayout, TeacherLayout, WeightSync
from megatron_gkd.planning.model import model_shape
from megatron_gkd.planning.student import StudentPlan, plan_student
from megatron_gkd.planning.teacher import TeacherPlan, plan_teacher
from megatron_gkd.planning.teacher_head import TeacherHeadShape

RECOMPUTE_ORDER = (None, "selective", "full")


@dataclasses.dataclass(kw_only=True)
class Rejected:
    layout: str
    reason: str


@dataclasses.dataclass(kw_only=True)
class Proposal:
    cluster: Cluster
    batch: Batch
    teacher: TeacherPlan | None
    teacher_devices: int
    teacher_rejected: list[Rejected]
    student: StudentPlan | None
    student_devices: int
    student_rejected: list[Rejected]
    student_budget_bytes: int
    """What the student may use per device: the device's usable memory less a colocated rollout engine."""
    problems: list[str]


def _powers_of_two(limit: int) -> list[int]:
    values, value = [], 1
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def teacher_candidates(hf_config: dict, cluster: Cluster, base: TeacherLayout) -> list[TeacherLayout]:
    """vLLM layouts in the order tried: fewest devices (several nodes: fewest nodes, all their devices),
    then less pipeline parallelism, then without expert parallelism."""
    m = model_shape(hf_config)
    candidates = []
    for tp in _powers_of_two(cluster.devices_per_node):
        for pp in range(1, cluster.nodes * cluster.devices_per_node // tp + 1):
            if tp * pp > cluster.devices_per_node and tp != cluster.devices_per_node:
                continue  # across nodes: full-node TP, pipeline between nodes
            for ep in (False, True) if m.is_moe else (False,):
                candidates.append(
                    dataclasses.replace(
                        base, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep
                    )
                )

    def order(c: TeacherLayout) -> tuple:
        if cluster.nodes == 1:  # the student gets the devices the teacher leaves in the node
            return (c.num_devices, c.pipeline_parallel_size, c.enable_expert_parallel)
        # Several nodes: the teacher takes whole nodes, so among layouts on as many nodes use them all.
        nodes = -(-c.num_devices // cluster.devices_per_node)
        return (nodes, -c.num_devices, c.pipeline_parallel_size, c.enable_expert_parallel)

    return sorted(candidates, key=order)


def student_candidates(
    hf_config: dict, num_devices: int, devices_per_node: int, base: StudentLayout
) -> list[StudentLayout]:
    """Megatron layouts in the order tried: smallest TP x PP, no recompute first, smallest EP, TP before PP."""
    m = model_shape(hf_config)
    candidates = []
    for tp in _powers_of_two(min(devices_per_node, num_devices)):
        for pp in _divisors(m.num_layers):
            if num_devices % (tp * pp):
                continue
            dp = num_devices // (tp * pp)
            for ep in [e for e in _divisors(m.num_experts) if dp * tp % e == 0] if m.is_moe else [1]:
                for recompute in RECOMPUTE_ORDER:
                    candidates.append(
                        dataclasses.replace(
                            base,
                            tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=1 if m.is_moe else None,
                            data_parallel_size=dp,
                            sequence_parallel=tp > 1,
                            use_distributed_optimizer=base.use_distributed_optimizer and dp > 1,
                            recompute_granularity=recompute,
                        )
                    )
    return sorted(
        candidates,
        key=lambda c: (
            c.tensor_model_parallel_size * c.pipeline_model_parallel_size,
            RECOMPUTE_ORDER.index(c.recompute_granularity),
            c.expert_model_parallel_size,
            c.pipeline_model_parallel_size,
        ),
    )


def _student_problem(plan: StudentPlan, usable: int) -> str | None:
    peak = plan.peak
    memory = peak.memory
    if memory.total <= usable:
        return None
    names = ("weights", "grads", "optimizer", "activations", "backward_workspace", "teacher_topk", "weight_sync")
    parts = [(name, getattr(memory, name)) for name in names]
    listed = " + ".join(f"{name} {value / 2**30:.1f}" for name, value in parts if value >= 0.05 * 2**30)
    return f"stage {peak.pp_rank}: {listed} = {memory.total / 2**30:.1f} GiB > {usable / 2**30:.1f} GiB usable"


def propose(
    student_hf: dict,
    cluster: Cluster,
    batch: Batch,
    *,
    teacher_hf: dict | None = None,
    student_base: StudentLayout | None = None,
    teacher_base: TeacherLayout | None = None,
    weight_sync: WeightSync | None = None,
    min_concurrent_sequences: int = 1,
    rollout_memory_fraction: float = 0.0,
    teacher_head: TeacherHeadShape | None = None,
) -> Proposal:
    """The teacher layout with the fewest devices, then the student's on the devices left.

    Args:
        student_hf, teacher_hf: HF ``config.json`` dicts (no teacher: the student gets every device).
        cluster: nodes x devices x memory.
        batch: sequence length, micro-batches, top-k, loss.
        student_base / teacher_base: settings the search keeps (dtype, kernels, optimizer sharding,
            vLLM memory settings); the parallel sizes are what it varies.
        weight_sync: the trainer's bucket settings (default: ``WeightSync()``).
        min_concurrent_sequences: full-length sequences the teacher's KV cache must hold at once.
        rollout_memory_fraction: share of each student device a colocated vLLM rollout engine keeps
            while the trainer runs (0: it sleeps and frees its memory, or runs on other devices).
        teacher_head: the teacher's output layer when it sends hidden states (``teacher.signal=hidden``):
            every student layout is planned with its vocabulary shard (see :func:`plan_student`).
    """
    if not 0 <= rollout_memory_fraction < 1:
        raise ValueError(f"rollout_memory_fraction={rollout_memory_fraction} must be in [0, 1)")
    student_base = student_base or StudentLayout(use_distributed_optimizer=True)
    teacher_base = teacher_base or TeacherLayout()
    weight_sync = weight_sync or WeightSync()
    problems: list[str] = []
    teacher, teacher_devices, teacher_rejected = None, 0, []
    if teacher_hf is not None:
        for layout in teacher_candidates(teacher_hf, cluster, teacher_base):
            try:
                plan = plan_teacher(
                    teacher_hf, layout, batch, cluster.device, min_concurrent_sequences=min_concurrent_sequences
                )
            except ValueError as error:
                teacher_rejected.append(Rejected(layout=layout.describe(), reason=str(error)))
                continue
            if plan.feasible:
                teacher = plan
                break
            # The fullest stage says enough; the others fail the same way or not at all.
            teacher_rejected.append(Rejected(layout=layout.describe(), reason=plan.peak.problem or plan.problems[0]))
        if teacher is None:
            problems.append(f"no teacher layout fits {cluster.describe()}")
        else:
            used = teacher.layout.num_devices
            whole_nodes = -(-used // cluster.devices_per_node) * cluster.devices_per_node
            teacher_devices = used if cluster.nodes == 1 else whole_nodes
    student_devices = cluster.num_devices - teacher_devices
    budget = cluster.device.usable_bytes - int(rollout_memory_fraction * cluster.device.memory_bytes)
    student, student_rejected = None, []
    if student_devices < 1:
        problems.append("no devices left for the student; add nodes")
    else:
        for layout in student_candidates(student_hf, student_devices, cluster.devices_per_node, student_base):
            try:
                plan = plan_student(student_hf, layout, batch, weight_sync, teacher_head=teacher_head)
            except ValueError as error:
                student_rejected.append(Rejected(layout=layout.describe(), reason=str(error)))
                continue
            reason = _student_problem(plan, budget)
            if reason is None:
                student = plan
                break
            student_rejected.append(Rejected(layout=layout.describe(), reason=reason))
        if student is None:
            problems.append(f"no student layout fits {student_devices} x {cluster.device.name}")
    return Proposal(
        cluster=cluster,
        batch=batch,
        teacher=teacher,
        teacher_devices=teacher_devices,
        teacher_rejected=teacher_rejected,
        student=student,
        student_devices=student_devices,
        student_rejected=student_rejected,
        student_budget_bytes=budget,
        problems=problems,
    )
