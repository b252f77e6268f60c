"""Tensor-parallel groups of a vLLM engine's bundles must each stay inside one node."""

import pytest

from megatron_gkd.launcher.ray_cluster import alive_gpu_nodes, check_tp_groups


def test_whole_groups_per_node_pass():
    check_tp_groups(["a"] * 8 + ["b"] * 8, 8)
    check_tp_groups(["a"] * 4 + ["b"] * 8, 4)


def test_a_split_group_names_the_counts():
    with pytest.raises(ValueError, match=r"\{'a': 6, 'b': 2\}"):
        check_tp_groups(["a"] * 6 + ["b"] * 2, 4)


def test_only_alive_nodes_count():
    nodes = [{"NodeID": "x", "Alive": True, "Resources": {"GPU": 8.0}},
             {"NodeID": "y", "Alive": False, "Resources": {"GPU": 8.0}},
             {"NodeID": "z", "Alive": True, "Resources": {"CPU": 4.0}}]
    assert alive_gpu_nodes(nodes) == {"x": 8.0, "z": 0.0}
