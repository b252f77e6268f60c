"""``python -m megatron_gkd.planning``: parameter counts, memory plans and layout proposals.

Examples::

    python -m megatron_gkd.planning params --hf configs/hf/deepseek-v3
    python -m megatron_gkd.planning student --hf configs/hf/qwen3-8b --tp 2 --dp 4 --sp --seq-length 8192
    python -m megatron_gkd.planning student --hf configs/hf/qwen3-8b --tp 2 --teacher-head configs/hf/qwen3-30b-a3b
    python -m megatron_gkd.planning teacher --hf configs/hf/deepseek-v3 --tp 8 --pp 2 --device h100-80gb
    python -m megatron_gkd.planning propose --student configs/hf/qwen3-30b-a3b --teacher configs/hf/deepseek-v3 \\
        --nodes 4 --devices-per-node 8 --device h100-80gb --seq-length 8192 --num-microbatches 8

Every command prints a table, or the same plan as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron_gkd.planning.cluster import DEVICES, Cluster, Device, get_device
from megatron_gkd.planning.layout import (
    DTYPE_BYTES,
    KERNELS,
    LOSSES,
    TEACHER_WEIGHTS,
    Batch,
    StudentLayout,
    TeacherLayout,
    WeightSync,
)
from megatron_gkd.planning.model import model_shape, read_config
from megatron_gkd.planning.params import count_parameters
from megatron_gkd.planning.propose import propose
from megatron_gkd.planning.report import counts_line, proposal_text, student_table, teacher_table, to_dict
from megatron_gkd.planning.student import plan_student
from megatron_gkd.planning.teacher import plan_teacher
from megatron_gkd.planning.teacher_head import TeacherHeadShape, read_teacher_head


def _add_batch(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batch")
    group.add_argument("--seq-length", type=int, default=4096, help="tokens per sample, prompt + response")
    group.add_argument("--micro-batch-size", type=int, default=1)
    group.add_argument("--num-microbatches", type=int, default=1, help="per data-parallel rank and step")
    group.add_argument("--top-k", type=int, default=64, help="teacher log-probs per token")
    group.add_argument("--loss", choices=LOSSES, default="distill")
    group.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk of a chunked loss")
    group.add_argument("--teacher-head", default=None, metavar="HF",
                       help="teacher.signal=hidden: the teacher's checkpoint or config.json, whose output layer "
                            "the student's last stage holds (student and propose)")


def _add_device(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("device")
    group.add_argument("--device", default=None, help=f"preset: {', '.join(DEVICES)}")
    group.add_argument("--device-memory-gib", type=float, default=None, help="total memory (overrides the preset)")
    group.add_argument("--device-reserved-gib", type=float, default=None, help="runtime reserve (context, NCCL)")


def _add_student_layout(parser: argparse.ArgumentParser, *, sizes: bool) -> None:
    group = parser.add_argument_group("student layout")
    if sizes:
        group.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
        group.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
        group.add_argument("--vpp", type=int, default=None, help="virtual_pipeline_model_parallel_size")
        group.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size")
        group.add_argument("--etp", type=int, default=None, help="expert_tensor_parallel_size")
        group.add_argument("--dp", type=int, default=1, help="data_parallel_size")
        group.add_argument("--sp", action="store_true", help="sequence_parallel")
        group.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
        group.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
        group.add_argument("--recompute-num-layers", type=int, default=1)
        group.add_argument("--distributed-optimizer", action="store_true")
        group.add_argument("--first-stage-layers", type=int, default=None)
        group.add_argument("--last-stage-layers", type=int, default=None)
    else:
        group.add_argument("--no-distributed-optimizer", action="store_true")
    group.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="student params_dtype")
    group.add_argument("--grad-dtype-params", action="store_true", help="gradient buffer in params_dtype, not fp32")
    group.add_argument("--kernels", choices=KERNELS, default="fused")
    group.add_argument("--include-mtp", action="store_true", help="train the MTP layers too")
    group.add_argument("--moe-imbalance", type=float, default=1.0)
    group.add_argument("--bucket-size-mb", type=float, default=512.0, help="weight-sync bucket size")
    group.add_argument("--num-buffers", type=int, default=2, help="weight-sync buckets per side")


def _add_teacher_layout(parser: argparse.ArgumentParser, *, sizes: bool, prefix: str = "") -> None:
    group = parser.add_argument_group("teacher (vLLM)")
    if sizes:
        group.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
        group.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
        group.add_argument("--dp", type=int, default=1, help="data_parallel_size")
        group.add_argument("--enable-expert-parallel", action="store_true")
    group.add_argument(f"--{prefix}weights-dtype", choices=TEACHER_WEIGHTS, default="auto")
    group.add_argument(f"--{prefix}kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    group.add_argument(f"--{prefix}gpu-memory-utilization", type=float, default=0.9)
    group.add_argument(f"--{prefix}max-num-batched-tokens", type=int, default=8192)
    group.add_argument("--min-concurrent-sequences", type=int, default=1, help="full-length sequences in KV at once")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.planning", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    params = commands.add_parser("params", help="parameter counts of an HF config")
    params.add_argument("--hf", required=True, help="HF checkpoint directory or config.json")
    student = commands.add_parser("student", help="per-stage training memory of a student layout")
    student.add_argument("--hf", required=True)
    _add_student_layout(student, sizes=True)
    _add_batch(student)
    teacher = commands.add_parser("teacher", help="per-stage memory of a vLLM teacher layout")
    teacher.add_argument("--hf", required=True)
    _add_teacher_layout(teacher, sizes=True)
    _add_batch(teacher)
    _add_device(teacher)
    proposal = commands.add_parser("propose", help="smallest feasible teacher and student layouts for a cluster")
    proposal.add_argument("--student", required=True, help="student HF checkpoint directory or config.json")
    proposal.add_argument("--teacher", default=None, help="teacher HF checkpoint directory or config.json")
    proposal.add_argument("--nodes", type=int, required=True)
    proposal.add_argument("--devices-per-node", type=int, default=8)
    proposal.add_argument(
        "--rollout-memory-fraction",
        type=float,
        default=0.0,
        help="share of each student device a colocated vLLM rollout engine keeps during training",
    )
    _add_device(proposal)
    _add_student_layout(proposal, sizes=False)
    _add_teacher_layout(proposal, sizes=False, prefix="teacher-")
    _add_batch(proposal)
    for sub in (params, student, teacher, proposal):
        sub.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _device(args: argparse.Namespace, required: bool) -> Device | None:
    if args.device is None and args.device_memory_gib is None:
        if required:
            raise SystemExit("give --device (a preset) or --device-memory-gib")
        return None
    base = get_device(args.device) if args.device else Device(name="custom", memory_gib=args.device_memory_gib)
    changes = {}
    if args.device_memory_gib is not None:
        changes["memory_gib"] = args.device_memory_gib
    if args.device_reserved_gib is not None:
        changes["reserved_gib"] = args.device_reserved_gib
    return dataclasses.replace(base, **changes)


def _batch(args: argparse.Namespace) -> Batch:
    return Batch(
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches,
        top_k=args.top_k,
        loss=args.loss,
        chunk_size=args.chunk_size,
    )


def _student_layout(args: argparse.Namespace, *, sizes: bool) -> StudentLayout:
    fields = dict(
        params_dtype=args.dtype,
        grad_reduce_in_fp32=not args.grad_dtype_params,
        kernels=args.kernels,
        include_mtp=args.include_mtp,
        moe_imbalance=args.moe_imbalance,
    )
    if not sizes:
        return StudentLayout(use_distributed_optimizer=not args.no_distributed_optimizer, **fields)
    return StudentLayout(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        data_parallel_size=args.dp,
        sequence_parallel=args.sp,
        use_distributed_optimizer=args.distributed_optimizer,
        recompute_granularity=None if args.recompute == "none" else args.recompute,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        num_layers_in_first_pipeline_stage=args.first_stage_layers,
        num_layers_in_last_pipeline_stage=args.last_stage_layers,
        **fields,
    )


def _teacher_head(args: argparse.Namespace) -> TeacherHeadShape | None:
    if args.teacher_head is None:
        return None
    if args.command == "teacher":
        raise ValueError("--teacher-head plans the student's copy of the teacher's output layer; "
                         "give it to the student or propose command")
    return read_teacher_head(args.teacher_head)


def _teacher_layout(args: argparse.Namespace, prefix: str = "") -> TeacherLayout:
    option = lambda name: getattr(args, prefix + name)  # noqa: E731
    sizes = {}
    if not prefix:
        sizes = dict(
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            data_parallel_size=args.dp,
            enable_expert_parallel=args.enable_expert_parallel,
        )
    return TeacherLayout(
        weights_dtype=option("weights_dtype"),
        kv_cache_dtype=option("kv_cache_dtype"),
        gpu_memory_utilization=option("gpu_memory_utilization"),
        max_num_batched_tokens=option("max_num_batched_tokens"),
        **sizes,
    )


def run(argv: list[str] | None = None) -> tuple[object, str, bool]:
    """Parses ``argv`` and computes the plan: ``(plan object, table text, whether JSON was asked)``."""
    args = build_parser().parse_args(argv)
    plan, text = _compute(args)
    return plan, text, args.json


def _compute(args: argparse.Namespace) -> tuple[object, str]:
    if args.command == "params":
        counts = count_parameters(model_shape(read_config(args.hf)))
        groups = ", ".join(f"{name} {value / 1e9:.3f} B" for name, value in counts.by_group.items())
        stored = counts.checkpoint_elements / 1e9
        text = f"{counts_line(counts)}\n  by group: {groups}\n  checkpoint elements: {stored:.3f} B"
        return counts, text
    teacher_head = _teacher_head(args)
    weight_sync = None
    if args.command != "teacher":
        weight_sync = WeightSync(bucket_size_mb=args.bucket_size_mb, num_buffers=args.num_buffers)
    if args.command == "student":
        plan = plan_student(read_config(args.hf), _student_layout(args, sizes=True), _batch(args), weight_sync,
                            teacher_head=teacher_head)
        return plan, student_table(plan)
    if args.command == "teacher":
        plan = plan_teacher(
            read_config(args.hf),
            _teacher_layout(args),
            _batch(args),
            _device(args, required=False),
            min_concurrent_sequences=args.min_concurrent_sequences,
        )
        return plan, teacher_table(plan)
    cluster = Cluster(nodes=args.nodes, devices_per_node=args.devices_per_node, device=_device(args, required=True))
    proposal = propose(
        read_config(args.student),
        cluster,
        _batch(args),
        teacher_hf=read_config(args.teacher) if args.teacher else None,
        student_base=_student_layout(args, sizes=False),
        teacher_base=_teacher_layout(args, prefix="teacher_"),
        weight_sync=weight_sync,
        min_concurrent_sequences=args.min_concurrent_sequences,
        rollout_memory_fraction=args.rollout_memory_fraction,
        teacher_head=teacher_head,
    )
    return proposal, proposal_text(proposal)


def main(argv: list[str] | None = None) -> int:
    try:
        plan, text, as_json = run(argv)
    except (ValueError, FileNotFoundError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    sys.stdout.write((json.dumps(to_dict(plan), indent=2) if as_json else text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
