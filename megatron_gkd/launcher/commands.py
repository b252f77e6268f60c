"""The commands a job runs on its nodes: torchrun rendezvous, Ray's head and workers, the teacher service.

Every command is a list of arguments (never a shell string), started through ``python -m`` of the
interpreter that runs the launcher, so every node uses the same environment (a shared file system,
as Slurm clusters have).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys

from megatron_gkd.launcher.nodes import Allocation, Node
from megatron_gkd.teacher.service.replicas import backend_arg_flags

TRAINER_CLI = "megatron_gkd.trainer.cli"
"""The trainer's command line (``launch/pretrain_gkd.py`` calls it), run with ``python -m`` / ``torchrun -m``."""


@dataclasses.dataclass(kw_only=True)
class Step:
    """One command started on some nodes, one task per node (a Slurm job step).

    Attributes:
        name: what it is (``student``, ``teacher``, ``ray-head``...), also the step's job name.
        nodes: where it runs.
        command: the task's arguments.
        env: variables added to the launcher's environment.
        signal_target: whether preemption signals go to it (the trainer's steps).
    """

    name: str
    nodes: tuple[Node, ...]
    command: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    signal_target: bool = False

    def describe(self) -> str:
        where = ",".join(node.name for node in self.nodes)
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return f"[{self.name}] on {where}: {env + ' ' if env else ''}{shlex.join(self.command)}"


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def torchrun(allocation: Allocation, module: str, args: list[str], *, port: int,
             rdzv_backend: str = "c10d", node_rank: int | None = None, max_restarts: int = 0) -> list[str]:
    """``torchrun -m module`` for ``allocation``'s nodes, its rendezvous on the first node.

    Args:
        rdzv_backend: ``c10d`` (every node runs the same command; ranks are given out at the
            rendezvous) or ``static`` (``node_rank`` fixes which node holds rank 0: services that must
            listen on a known node use it).
        node_rank: the node's index (``static`` only).
        max_restarts: ``c10d`` only: how often torchrun stops every rank and starts them again after one fails
            (the trainer resumes from its newest complete checkpoint); its environment then needs
            :data:`megatron_gkd.parallel.state.RESTART_ENV`.
    """
    endpoint = f"{allocation.head.address}:{port}"
    args_ = [f"--nnodes={allocation.num_nodes}", f"--nproc-per-node={allocation.nproc_per_node}"]
    if rdzv_backend == "c10d":
        run_id = allocation.job_id or "gkd"
        args_ += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--max-restarts={max_restarts}"]
    elif rdzv_backend == "static":
        if node_rank is None:
            raise ValueError("a static rendezvous needs the node's rank")
        args_ += [f"--node-rank={node_rank}", f"--master-addr={allocation.head.address}", f"--master-port={port}"]
        if max_restarts:
            raise ValueError("a static rendezvous cannot restart its ranks; use c10d")
    else:
        raise ValueError(f"unknown rendezvous backend {rdzv_backend!r}; use 'c10d' or 'static'")
    return python_module("torch.distributed.run", *args_, "-m", module, *args)


def trainer_args(config_path: str | None, overrides: list[str]) -> list[str]:
    """The trainer's arguments: the config and the dotted overrides, unchanged."""
    return ([f"--config={config_path}"] if config_path else []) + list(overrides)


def teacher_serve_args(*, frontend: str, backend: str, model: str, backend_args: dict, secret_file: str) -> list[str]:
    """The teacher service's ``serve``: a proxy and one worker, the backend in the same process (rank 0)."""
    return ["serve", f"--frontend={frontend}", f"--backend={backend}", f"--model={model}",
            *backend_arg_flags(backend_args), f"--secret-file={secret_file}"]


def ray_start(*, head: Node, port: int, num_gpus: int, is_head: bool) -> list[str]:
    """``ray start`` in the foreground (``--block``): the step lives as long as the Ray node."""
    common = [f"--num-gpus={num_gpus}", "--block", "--disable-usage-stats"]
    if is_head:
        return python_module("ray.scripts.scripts", "start", "--head", f"--port={port}", "--include-dashboard=false",
                             *common)
    return python_module("ray.scripts.scripts", "start", f"--address={head.address}:{port}", *common)
