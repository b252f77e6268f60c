"""The machines a job runs on: a Slurm allocation, this one machine, or made-up nodes for a dry run."""

from __future__ import annotations

import dataclasses
import os
import subprocess


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One machine of the job.

    Attributes:
        name: the scheduler's name for it (``srun --nodelist``).
        address: where the other nodes reach it (Slurm's ``NodeAddr``: a hostname or an IP).
    """

    name: str
    address: str


@dataclasses.dataclass(frozen=True, slots=True)
class Allocation:
    """Nodes with the same number of devices (processes) each.

    Attributes:
        nodes: the machines, in the scheduler's order (the first one hosts the rendezvous).
        nproc_per_node: processes (devices) per node.
        scheduler: ``slurm`` (steps started with ``srun``), ``local`` (this machine, no scheduler) or
            ``dry-run`` (nothing is started).
        job_id: the Slurm job id (``None`` outside Slurm).
    """

    nodes: tuple[Node, ...]
    nproc_per_node: int
    scheduler: str
    job_id: str | None = None

    def __post_init__(self):
        if not self.nodes:
            raise ValueError("an allocation needs at least one node")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node={self.nproc_per_node} must be >= 1")
        if self.scheduler not in ("slurm", "local", "dry-run"):
            raise ValueError(f"unknown scheduler {self.scheduler!r}")

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    def split(self, first: int) -> tuple[Allocation, Allocation]:
        """``(the first `first` nodes, the rest)``; on one local machine both halves are that machine.

        Raises:
            ValueError: ``first`` leaves one side without a node.
        """
        if self.scheduler == "local":
            return self, self
        if not 0 < first < self.num_nodes:
            raise ValueError(f"cannot give {first} of {self.num_nodes} node(s) to the teacher and keep at least one "
                             f"for the student; use --teacher-nodes between 1 and {self.num_nodes - 1} or more nodes")
        return (dataclasses.replace(self, nodes=self.nodes[:first]),
                dataclasses.replace(self, nodes=self.nodes[first:]))

    def describe(self) -> str:
        names = ", ".join(f"{node.name} ({node.address})" if node.address != node.name else node.name
                          for node in self.nodes)
        return f"{self.num_nodes} node(s) x {self.nproc_per_node} process(es): {names}"


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def slurm_allocation(nproc_per_node: int, env: dict[str, str] | None = None) -> Allocation:
    """The nodes of the Slurm job this process runs in (``SLURM_JOB_NODELIST``), with their addresses.

    Raises:
        ValueError: not inside a Slurm job.
    """
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError("not inside a Slurm job (SLURM_JOB_NODELIST is unset): submit with sbatch, run inside "
                         "salloc, use --local for this machine alone, or --dry-run to print the plan")
    names = _scontrol("show", "hostnames", nodelist).split()
    addresses = {}
    for line in _scontrol("show", "node", "--oneliner", nodelist).splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    nodes = tuple(Node(name, addresses.get(name, name)) for name in names)
    return Allocation(nodes=nodes, nproc_per_node=nproc_per_node, scheduler="slurm", job_id=env.get("SLURM_JOB_ID"))


def local_allocation(nproc_per_node: int) -> Allocation:
    """This machine alone: every step runs here and services listen on loopback."""
    return Allocation(nodes=(Node("localhost", "127.0.0.1"),), nproc_per_node=nproc_per_node, scheduler="local")


def dry_run_allocation(num_nodes: int, nproc_per_node: int) -> Allocation:
    """``num_nodes`` made-up nodes ``node0 ..``: what a job of that size would do."""
    if num_nodes < 1:
        raise ValueError(f"--nodes={num_nodes} must be >= 1")
    return Allocation(nodes=tuple(Node(f"node{i}", f"node{i}") for i in range(num_nodes)),
                      nproc_per_node=nproc_per_node, scheduler="dry-run", job_id="DRYRUN")


def default_nproc_per_node(env: dict[str, str] | None = None) -> int:
    """Devices per node as Slurm tells them (``SLURM_GPUS_ON_NODE``), else 8 (an 8-GPU node)."""
    env = os.environ if env is None else env
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "").split(":")[-1]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 8
