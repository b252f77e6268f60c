"""Ray for a vLLM teacher across nodes: wait until every node has joined, then prove the engine's
placement before vLLM spends minutes loading weights.

vLLM's Ray executor asks for ``TP x PP`` bundles of one GPU each and gives consecutive ranks (one
tensor-parallel group) to the workers of one node. A tensor-parallel group split over two nodes
would run its all-reduces over the network, so the gate reserves the same bundles first and checks
that every node holds a whole number of TP groups, then releases them.

    python -m megatron_gkd.launcher.ray_cluster --address HEAD:6379 --nodes 2 --gpus-per-node 8 --tp 8 --pp 2
"""

from __future__ import annotations

import argparse
import collections
import logging
import time

from megatron_gkd.log_setup import setup_logging

logger = logging.getLogger(__name__)


def alive_gpu_nodes(nodes: list[dict]) -> dict[str, float]:
    """``{node id: GPUs}`` of the alive nodes in ``ray.nodes()``."""
    return {node["NodeID"]: node.get("Resources", {}).get("GPU", 0.0) for node in nodes if node.get("Alive")}


def wait_for_nodes(num_nodes: int, gpus_per_node: int, timeout_s: float, poll_s: float = 1.0) -> dict[str, float]:
    """Waits (connected with ``ray.init``) until ``num_nodes`` alive nodes with ``gpus_per_node`` GPUs each.

    Raises:
        TimeoutError: they did not all join within ``timeout_s`` (the message lists who did).
    """
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        nodes = alive_gpu_nodes(ray.nodes())
        ready = {node: gpus for node, gpus in nodes.items() if gpus >= gpus_per_node}
        if len(ready) >= num_nodes:
            return ready
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray lists {len(ready)} of {num_nodes} node(s) with {gpus_per_node} GPU(s) after "
                               f"{timeout_s:.0f} s (alive: {nodes}); check the ray-workers step's log")
        time.sleep(poll_s)


def check_tp_groups(bundle_nodes: list[str], tensor_parallel_size: int) -> None:
    """Every node holds a whole number of tensor-parallel groups of the engine's bundles.

    Raises:
        ValueError: some node holds part of a group (the message counts bundles per node).
    """
    counts = collections.Counter(bundle_nodes)
    split = {node: count for node, count in counts.items() if count % tensor_parallel_size}
    if split:
        raise ValueError(f"tensor-parallel groups of {tensor_parallel_size} would span nodes: bundles per node "
                         f"{dict(counts)}; make TP divide each node's GPU count (TP within a node, PP across)")


def reserve_engine_bundles(tensor_parallel_size: int, pipeline_parallel_size: int, timeout_s: float) -> list[str]:
    """Reserves the engine's ``TP x PP`` one-GPU bundles as vLLM does (``PACK``), returns the node of each
    bundle in bundle order, checks the TP groups (:func:`check_tp_groups`) and releases them.

    Raises:
        TimeoutError: Ray could not place them within ``timeout_s`` (GPUs busy or too few).
        ValueError: a TP group would span nodes.
    """
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    count = tensor_parallel_size * pipeline_parallel_size
    group = placement_group([{"GPU": 1.0}] * count, strategy="PACK")
    try:
        if not group.wait(timeout_s):
            raise TimeoutError(f"Ray could not place {count} one-GPU bundles within {timeout_s:.0f} s")
        table = placement_group_table(group)
        bundle_nodes = [table["bundles_to_node_id"][index] for index in range(count)]
    finally:
        remove_placement_group(group)
    check_tp_groups(bundle_nodes, tensor_parallel_size)
    return bundle_nodes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True, help="the Ray head, HOST:PORT")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--tp", type=int, default=None, help="check the engine's placement for this TP (with --pp)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    import ray

    setup_logging("INFO")
    ray.init(address=args.address, logging_level=logging.WARNING)
    try:
        nodes = wait_for_nodes(args.nodes, args.gpus_per_node, args.timeout)
        logger.info("Ray lists %d node(s): %s", len(nodes), nodes)
        if args.tp:
            bundle_nodes = reserve_engine_bundles(args.tp, args.pp, args.timeout)
            logger.info("TP %d x PP %d places %s bundle(s) per node", args.tp, args.pp,
                        dict(collections.Counter(bundle_nodes)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
