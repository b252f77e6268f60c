"""Nodes of a Slurm job (names and addresses from scontrol), local and dry-run allocations, and splits."""

import pytest

from megatron_gkd.launcher import nodes


def test_slurm_allocation_reads_names_and_node_addresses(monkeypatch):
    replies = {("show", "hostnames", "gpu[07-08]"): "gpu07\ngpu08\n",
               ("show", "node", "--oneliner", "gpu[07-08]"):
                   "NodeName=gpu07 Arch=x86_64 NodeAddr=10.1.0.7 NodeHostName=gpu07\n"
                   "NodeName=gpu08 Arch=x86_64 NodeAddr=gpu08-ib NodeHostName=gpu08\n"}
    monkeypatch.setattr(nodes, "_scontrol", lambda *args: replies[args])
    allocation = nodes.slurm_allocation(8, {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"})
    assert allocation.nodes == (nodes.Node("gpu07", "10.1.0.7"), nodes.Node("gpu08", "gpu08-ib"))
    assert (allocation.job_id, allocation.world_size, allocation.head.address) == ("1234", 16, "10.1.0.7")


def test_outside_slurm_the_error_says_what_to_do():
    with pytest.raises(ValueError, match="--local .* --dry-run"):
        nodes.slurm_allocation(8, {})


def test_split_gives_the_first_nodes_to_the_teacher():
    allocation = nodes.dry_run_allocation(4, 8)
    teacher, student = allocation.split(2)
    assert [n.name for n in teacher.nodes] == ["node0", "node1"] and [n.name for n in student.nodes] == ["node2", "node3"]
    with pytest.raises(ValueError, match="--teacher-nodes between 1 and 3"):
        allocation.split(4)
    local = nodes.local_allocation(2)
    assert local.split(1) == (local, local)  # one machine: both share it


def test_devices_per_node_from_slurm():
    assert nodes.default_nproc_per_node({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert nodes.default_nproc_per_node({"SLURM_GPUS_PER_NODE": "h100:8"}) == 8
    assert nodes.default_nproc_per_node({}) == 8
