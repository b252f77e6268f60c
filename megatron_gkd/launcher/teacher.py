"""How the teacher service is laid over its nodes: which processes start where, in what order, and
the address clients use.

- ``vllm``: one vLLM engine; on several nodes its workers are Ray actors, so a Ray head runs on the
  first node, a Ray worker on each other node, and the service (proxy + the engine's driver) on the
  first node once Ray lists every node (``distributed_executor_backend=ray``).
- ``megatron``: the Megatron teacher under torchrun over all the nodes (static rendezvous, so rank 0,
  which serves, is on the first node).
- ``hf`` and other single-process backends: one process on one node.
"""

from __future__ import annotations

import dataclasses
import shlex

from megatron_gkd.launcher import commands
from megatron_gkd.launcher.commands import Step
from megatron_gkd.launcher.nodes import Allocation
from megatron_gkd.teacher.service.replicas import TEACHER_CLI


@dataclasses.dataclass(kw_only=True)
class RayGate:
    """Wait until the Ray cluster at ``address`` lists ``num_nodes`` nodes with ``gpus_per_node`` GPUs each."""

    address: str
    num_nodes: int
    gpus_per_node: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    timeout_s: float = 1800.0

    def command(self) -> list[str]:
        """Run on the job's first node: connects to Ray, waits, checks the engine's placement."""
        return commands.python_module(
            "megatron_gkd.launcher.ray_cluster", f"--address={self.address}", f"--nodes={self.num_nodes}",
            f"--gpus-per-node={self.gpus_per_node}", f"--tp={self.tensor_parallel_size}",
            f"--pp={self.pipeline_parallel_size}", f"--timeout={self.timeout_s:g}")

    def describe(self) -> str:
        return (f"[wait] until Ray at {self.address} lists {self.num_nodes} node(s) with {self.gpus_per_node} GPU(s) "
                f"each and places TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} with every TP "
                f"group inside a node: {shlex.join(self.command())}")


@dataclasses.dataclass(kw_only=True)
class TeacherDeployment:
    """The teacher service's processes, in start order, and where clients reach it.

    Attributes:
        actions: steps and Ray gates, started and awaited in order.
        address: the proxy's frontend as clients on other nodes see it.
        backend, model, backend_args: what ``teacher_server.py`` serves (``backend_args`` as resolved).
        notes: what the launcher decided for the user (printed by dry runs and at start-up).
    """

    actions: list[Step | RayGate]
    address: str
    backend: str
    model: str
    backend_args: dict
    notes: list[str]

    @property
    def steps(self) -> list[Step]:
        return [action for action in self.actions if isinstance(action, Step)]


def _vllm_args(backend_args: dict, allocation: Allocation, notes: list[str]) -> dict:
    args = dict(backend_args)
    tp = args.setdefault("tensor_parallel_size", allocation.nproc_per_node)
    pp = args.setdefault("pipeline_parallel_size", allocation.num_nodes)
    dp = args.get("data_parallel_size", 1)
    if tp * pp * dp > allocation.world_size:
        raise ValueError(f"the vLLM teacher needs TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp} devices, its "
                         f"{allocation.num_nodes} node(s) have {allocation.world_size}: give the teacher more nodes "
                         "or lower teacher.serve.backend_args")
    if allocation.num_nodes > 1:
        executor = args.setdefault("distributed_executor_backend", "ray")
        if executor != "ray":
            raise ValueError(f"teacher.serve.backend_args.distributed_executor_backend={executor!r}: a vLLM engine "
                             "across nodes needs 'ray'")
        if tp > allocation.nproc_per_node:
            notes.append(f"tensor parallelism {tp} spans nodes ({allocation.nproc_per_node} devices each): "
                         "prefer TP within a node and PP across nodes")
    return args


def plan_teacher(serve, allocation: Allocation, *, secret_file: str, port: int, ray_port: int,
                 rdzv_port: int, timeout_s: float = 1800.0) -> TeacherDeployment:
    """The deployment of ``serve`` (the config's ``teacher.serve``) on ``allocation``.

    Raises:
        ValueError: the backend cannot use the nodes given (the message says what to change).
    """
    if not serve.model:
        raise ValueError("the teacher job serves teacher.serve.model: set it to the teacher's HF checkpoint")
    head, notes = allocation.head, []
    bind = "127.0.0.1" if allocation.scheduler == "local" else "0.0.0.0"
    backend_args = dict(serve.backend_args)
    if serve.backend == "vllm":
        backend_args = _vllm_args(backend_args, allocation, notes)
    elif serve.backend != "megatron" and allocation.num_nodes > 1:
        raise ValueError(f"the {serve.backend} teacher backend runs in one process on one node, it was given "
                         f"{allocation.num_nodes}: use --teacher-nodes 1, or the vllm or megatron backend")
    serve_args = commands.teacher_serve_args(frontend=f"tcp://{bind}:{port}", backend=serve.backend,
                                             model=str(serve.model), backend_args=backend_args,
                                             secret_file=secret_file)
    actions: list[Step | RayGate] = []
    env: dict[str, str] = {}
    if serve.backend == "megatron":
        for rank, node in enumerate(allocation.nodes):
            command = commands.torchrun(allocation, TEACHER_CLI, serve_args, port=rdzv_port,
                                        rdzv_backend="static", node_rank=rank)
            actions.append(Step(name=f"teacher-{rank}" if allocation.num_nodes > 1 else "teacher", nodes=(node,),
                                command=command))
        notes.append(f"megatron teacher on {allocation.world_size} rank(s); rank 0 on {head.name} serves")
    else:
        if backend_args.get("distributed_executor_backend") == "ray" and allocation.scheduler != "local":
            ray_address = f"{head.address}:{ray_port}"
            gpus = allocation.nproc_per_node
            actions.append(Step(name="ray-head", nodes=(head,),
                                command=commands.ray_start(head=head, port=ray_port, num_gpus=gpus, is_head=True)))
            if allocation.num_nodes > 1:
                actions.append(Step(name="ray-workers", nodes=allocation.nodes[1:],
                                    command=commands.ray_start(head=head, port=ray_port, num_gpus=gpus, is_head=False)))
            actions.append(RayGate(address=ray_address, num_nodes=allocation.num_nodes, gpus_per_node=gpus,
                                   tensor_parallel_size=backend_args["tensor_parallel_size"],
                                   pipeline_parallel_size=backend_args["pipeline_parallel_size"], timeout_s=timeout_s))
            env["RAY_ADDRESS"] = ray_address
            notes.append(f"vLLM over Ray: head on {head.name}, {allocation.num_nodes - 1} worker node(s)")
        actions.append(Step(name="teacher", nodes=(head,),
                            command=commands.python_module(TEACHER_CLI, *serve_args), env=env))
    return TeacherDeployment(actions=actions, address=f"tcp://{head.address}:{port}", backend=serve.backend,
                             model=str(serve.model), backend_args=backend_args, notes=notes)
