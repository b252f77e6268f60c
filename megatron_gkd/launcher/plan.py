"""What a job will do, computed before anything starts: the teacher's deployment, the student's step,
the overrides that point the student at the teacher, and the text a dry run prints."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import shlex

from megatron_gkd import planning
from megatron_gkd.config import load_config
from megatron_gkd.config.dry_run import layout_plan
from megatron_gkd.launcher import commands, memory
from megatron_gkd.launcher.commands import Step
from megatron_gkd.launcher.nodes import Allocation
from megatron_gkd.launcher.teacher import TeacherDeployment, plan_teacher
from megatron_gkd.parallel.state import RESTART_ENV
from megatron_gkd.teacher.service.replicas import backend_arg_flags

ROLES = ("student", "teacher", "combined")


@dataclasses.dataclass(kw_only=True)
class JobOptions:
    """A job's command line (``python -m megatron_gkd.launcher ROLE ...``)."""

    role: str
    config_path: str | None
    overrides: list[str]
    launch_dir: pathlib.Path
    """Where the job keeps its own files: the teacher's secret and address, the service logs."""
    device: planning.Device | None = None
    """Device of the memory plan (and of the teacher layout the planner chooses)."""
    kernels: str = "fused"
    teacher_nodes: int | None = None
    rdzv_port: int = 29400
    teacher_port: int = 5555
    teacher_rdzv_port: int = 29500
    ray_port: int = 6379
    health_timeout_s: float = 1800.0
    requeue: bool = True
    max_restarts: int = 3
    """How often torchrun restarts the student's ranks after one dies (each restart resumes from the newest
    complete checkpoint); 0: the job fails with the first rank."""

    @property
    def secret_file(self) -> pathlib.Path:
        return self.launch_dir / "teacher.secret"

    @property
    def address_file(self) -> pathlib.Path:
        return self.launch_dir / "teacher_address"


@dataclasses.dataclass(kw_only=True)
class JobPlan:
    options: JobOptions
    allocation: Allocation
    teacher: TeacherDeployment | None
    teacher_allocation: Allocation | None
    student: Step | None
    student_allocation: Allocation | None
    student_overrides: list[str]
    student_config: object | None
    """The trainer config the student runs with (the overrides applied)."""
    sections: list[tuple[str, str]]
    """Titled blocks of the dry-run text: layout, ranks, memory plans."""


def _teacher_nodes(config, options: JobOptions, allocation: Allocation, sections: list) -> int:
    """Nodes the teacher takes in a combined job: given, or what its layout needs (chosen by the planner
    when a vLLM teacher's config names no parallel sizes)."""
    if options.teacher_nodes is not None:
        return options.teacher_nodes
    serve, nproc = config.teacher.serve, allocation.nproc_per_node
    args = serve.backend_args
    if serve.backend == "vllm":
        if "tensor_parallel_size" not in args and "pipeline_parallel_size" not in args:
            if options.device is None:
                raise ValueError("give --teacher-nodes, the teacher's parallel sizes in teacher.serve.backend_args, "
                                 "or --device for the planner to choose them")
            layout, text = memory.choose_teacher_layout(config, allocation.num_nodes, nproc, options.device)
            sections.append(("teacher layout chosen by the planner", text))
            args.update(tensor_parallel_size=layout.tensor_parallel_size,
                        pipeline_parallel_size=layout.pipeline_parallel_size)
            if layout.enable_expert_parallel:
                args["enable_expert_parallel"] = True
        devices = (args.get("tensor_parallel_size", nproc) * args.get("pipeline_parallel_size", 1)
                   * args.get("data_parallel_size", 1))
    elif serve.backend == "megatron":
        devices = args.get("tensor_model_parallel_size", 1) * args.get("pipeline_model_parallel_size", 1)
    else:
        devices = 1
    return math.ceil(devices / nproc)


def _student_text(config, allocation: Allocation, rdzv: str) -> str:
    lines = [layout_plan(config, allocation.world_size)]
    nproc = allocation.nproc_per_node
    for index, node in enumerate(allocation.nodes):
        lines.append(f"node {node.name}: ranks {index * nproc}-{(index + 1) * nproc - 1}"
                     + (" (which node takes which block is settled at the rendezvous)" if index == 0 and
                        allocation.num_nodes > 1 and rdzv == "c10d" else ""))
    return "\n".join(lines)


def build_plan(options: JobOptions, config, allocation: Allocation) -> JobPlan:
    """The plan of ``options.role`` on ``allocation``.

    Raises:
        ValueError: the config does not fit the nodes (the message says what to change).
    """
    if options.role not in ROLES:
        raise ValueError(f"unknown job {options.role!r}; choose one of {list(ROLES)}")
    sections: list[tuple[str, str]] = []
    teacher = teacher_allocation = student = student_allocation = student_config = None
    student_overrides = list(options.overrides)
    if options.role in ("teacher", "combined"):
        teacher_allocation, student_allocation = allocation, None
        if options.role == "combined":
            count = _teacher_nodes(config, options, allocation, sections)
            teacher_allocation, student_allocation = allocation.split(count)
        teacher = plan_teacher(config.teacher.serve, teacher_allocation, secret_file=str(options.secret_file),
                               port=options.teacher_port, ray_port=options.ray_port,
                               rdzv_port=options.teacher_rdzv_port, timeout_s=options.health_timeout_s)
        text = [f"{teacher.backend} backend serving {teacher.model} on {teacher_allocation.describe()}",
                f"address {teacher.address}, shared secret in {options.secret_file} (written at start, mode 600)",
                "backend options: " + " ".join(backend_arg_flags(teacher.backend_args)[1::2])]
        sections.append(("teacher service", "\n".join(text + teacher.notes)))
        if options.role == "combined":
            student_overrides += ["teacher.serve.model=null", f"teacher.address={teacher.address}",
                                  f"teacher.secret_file={options.secret_file}"]
            if config.teacher.signal.needs_head and config.teacher.head_checkpoint is None:
                # The student still reads the teacher's output layer from the served checkpoint.
                student_overrides.append(f"teacher.head_checkpoint={config.teacher.serve.model}")
    else:
        student_allocation = allocation
    if student_allocation is not None:
        student_config = config if student_overrides == options.overrides else load_config(
            options.config_path, student_overrides)
        command = commands.torchrun(student_allocation, commands.TRAINER_CLI,
                                    commands.trainer_args(options.config_path, student_overrides),
                                    port=options.rdzv_port, max_restarts=options.max_restarts)
        student = Step(name="student", nodes=student_allocation.nodes, command=command, signal_target=True,
                       env=dict(RESTART_ENV) if options.max_restarts else {})
        sections.append((f"student on {student_allocation.describe()}", _student_text(
            student_config, student_allocation, "c10d")))
    plan = JobPlan(options=options, allocation=allocation, teacher=teacher, teacher_allocation=teacher_allocation,
                   student=student, student_allocation=student_allocation, student_overrides=student_overrides,
                   student_config=student_config, sections=sections)
    sections.append(("memory plan per device", _memory_text(plan, config)))
    return plan


def _memory_text(plan: JobPlan, config) -> str:
    options = plan.options
    device = options.device
    head = f"device {device.name} ({device.memory_gib:g} GiB)" if device else "no device given (--device)"
    lines = [f"{head}, {options.kernels} kernels"]
    if plan.teacher is not None:
        batch = memory.planning_batch(config)
        if plan.teacher.backend == "vllm":
            layout = memory.teacher_layout_from_args(plan.teacher.backend_args)
            lines.append(memory.teacher_plan_text(plan.teacher.model, layout, batch, device))
        else:
            lines.append(f"teacher: the planner models vLLM teachers; the {plan.teacher.backend} backend is not planned")
    if plan.student_allocation is not None:
        lines.append(memory.student_plan_text(plan.student_config, plan.student_allocation.world_size, device,
                                              options.kernels))
    return "\n".join(lines)


def dry_run_text(plan: JobPlan) -> str:
    """Everything the job would do, in order, without doing it."""
    options = plan.options
    lines = [f"megatron-gkd {options.role} job (dry run: nothing is started)",
             f"allocation: {plan.allocation.describe()} [{plan.allocation.scheduler}]",
             "trainer config: " + shlex.join(commands.trainer_args(options.config_path, plan.student_overrides))]
    for title, text in plan.sections:
        lines += ["", f"== {title}", text]
    lines += ["", "== commands, in order"]
    actions: list = list(plan.teacher.actions) if plan.teacher else []
    for action in actions:
        lines.append(action.describe())
    if plan.teacher is not None:
        lines.append(f"[wait] until the teacher at {plan.teacher.address} answers INFO (at most "
                     f"{options.health_timeout_s:.0f} s), then write it to {options.address_file}")
    if plan.student is not None:
        lines.append(plan.student.describe())
    if plan.teacher is not None and plan.student is not None:
        lines.append("[stop] the teacher's steps when the student ends, fails or is preempted")
    lines += ["", "== preemption", _preemption_text(plan)]
    if plan.student is not None:
        lines += ["", "== a rank that dies", _restart_text(plan.options.max_restarts)]
    return "\n".join(lines)


def _restart_text(max_restarts: int) -> str:
    if not max_restarts:
        return "the job fails with it (--max-restarts 0)"
    return (f"torchrun stops every rank of the student and starts them again, at most {max_restarts} time(s) "
            "(--max-restarts); they resume from the newest complete checkpoint (checkpoint.resume=auto): the steps "
            "after it are trained again, the data position and RNG as saved")


def _preemption_text(plan: JobPlan) -> str:
    if plan.student is None:
        return ("SIGUSR1 or SIGTERM to the job (e.g. #SBATCH --signal=B:USR1@300): the teacher's steps are stopped "
                "and the job exits 0")
    requeue = ("then `scontrol requeue` puts the job back in the queue and its next start resumes from the "
               "checkpoint (checkpoint.resume=auto)" if plan.options.requeue else "no requeue (--no-requeue)")
    return ("SIGUSR1 or SIGTERM to the job (e.g. #SBATCH --signal=B:USR1@300) is forwarded to every process of the "
            "student step; the trainer ranks checkpoint after their current step and exit 0 (torchrun ignores "
            f"SIGUSR1); {requeue}")
