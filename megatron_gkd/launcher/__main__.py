"""``python -m megatron_gkd.launcher {student,teacher,combined}``: what the Slurm scripts and
``launch/run_671b.sh`` run.

    # inside a Slurm job (sbatch launch/slurm/student.sbatch ... calls this):
    python -m megatron_gkd.launcher student --config configs/X.yaml trainer.num_steps=100
    # anywhere, nothing started: nodes, ranks, commands and the memory plan of a 4-node job
    python -m megatron_gkd.launcher combined --dry-run --nodes 4 --nproc-per-node 8 --device h100-80gb \\
        --config configs/deepseek_v3_671b.yaml teacher.serve.model=DIR student.checkpoint=DIR
    # one machine, no Slurm: the same flow with every step a local process
    python -m megatron_gkd.launcher combined --local --nproc-per-node 2 --config configs/X.yaml

A bad config or layout exits with status 2 and one line "config error: ...".
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from megatron_gkd import planning
from megatron_gkd.config import load_config
from megatron_gkd.launcher import nodes as nodes_
from megatron_gkd.launcher.plan import ROLES, JobOptions, build_plan, dry_run_text
from megatron_gkd.launcher.processes import LocalExecutor, SlurmExecutor
from megatron_gkd.launcher.runner import Job
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.trainer.checks import check_registered_names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=ROLES, help="student training, the teacher service, or both on split nodes")
    parser.add_argument("--config", help="the trainer's YAML preset")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="the trainer's dotted overrides")
    where = parser.add_argument_group("where")
    where.add_argument("--dry-run", action="store_true", help="print nodes, ranks, commands and the memory plan; exit")
    where.add_argument("--nodes", type=int, default=None, help="dry run: nodes of the job (default: $SLURM_NNODES or 1)")
    where.add_argument("--local", action="store_true", help="run every step on this machine (no Slurm)")
    where.add_argument("--nproc-per-node", type=int, default=None,
                       help="processes (devices) per node (default: $SLURM_GPUS_ON_NODE, else 8)")
    where.add_argument("--teacher-nodes", type=int, default=None,
                       help="combined: nodes of the teacher (default: what its layout needs)")
    where.add_argument("--launch-dir", default=None,
                       help="the job's own files: teacher secret, address and logs (default: <trainer.output_dir>/launch)")
    plan = parser.add_argument_group("memory plan")
    plan.add_argument("--device", default=None, help=f"device preset of the plan: {', '.join(planning.DEVICES)}")
    plan.add_argument("--kernels", choices=planning.layout.KERNELS, default="fused",
                      help="fused (accelerators) or local (Megatron's local spec, the CPU)")
    ports = parser.add_argument_group("ports")
    ports.add_argument("--rdzv-port", type=int, default=29400, help="the student's torchrun rendezvous")
    ports.add_argument("--teacher-port", type=int, default=5555, help="the teacher service's frontend")
    ports.add_argument("--teacher-rdzv-port", type=int, default=29500, help="a megatron teacher's torchrun")
    ports.add_argument("--ray-port", type=int, default=6379, help="the Ray head of a vLLM teacher across nodes")
    run = parser.add_argument_group("run")
    run.add_argument("--health-timeout", type=float, default=1800.0, help="seconds to wait for the teacher")
    run.add_argument("--no-requeue", action="store_true", help="after a preemption, exit instead of requeueing")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="torchrun restarts of the student's ranks after one dies, each resuming from the newest "
                          "complete checkpoint (0: fail with the first)")
    return parser


def _allocation(args: argparse.Namespace) -> nodes_.Allocation:
    nproc = args.nproc_per_node or nodes_.default_nproc_per_node()
    if args.local:
        return nodes_.local_allocation(nproc)
    if args.dry_run and (args.nodes is not None or "SLURM_JOB_NODELIST" not in os.environ):
        return nodes_.dry_run_allocation(args.nodes or int(os.environ.get("SLURM_NNODES", "1")), nproc)
    return nodes_.slurm_allocation(nproc)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)

    setup_logging("INFO")
    try:
        config = load_config(args.config, list(args.overrides))
        check_registered_names(config)
        allocation = _allocation(args)
        options = JobOptions(
            role=args.role, config_path=args.config, overrides=list(args.overrides),
            launch_dir=pathlib.Path(args.launch_dir or os.path.join(config.trainer.output_dir, "launch")),
            device=planning.get_device(args.device) if args.device else None, kernels=args.kernels,
            teacher_nodes=args.teacher_nodes, rdzv_port=args.rdzv_port, teacher_port=args.teacher_port,
            teacher_rdzv_port=args.teacher_rdzv_port, ray_port=args.ray_port,
            health_timeout_s=args.health_timeout, requeue=not args.no_requeue, max_restarts=args.max_restarts)
        plan = build_plan(options, config, allocation)
    except ValueError as error:
        sys.stderr.write(f"config error: {error}\n")
        return 2
    if args.dry_run:
        sys.stdout.write(dry_run_text(plan) + "\n")  # the dry run's product: plain text on stdout
        return 0

    executor_class = LocalExecutor if allocation.scheduler == "local" else SlurmExecutor
    return Job(plan, executor_class(options.launch_dir)).run()


if __name__ == "__main__":
    sys.exit(main())
