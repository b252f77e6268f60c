"""The rollout server process of the disaggregated layout: ``python -m megatron_gkd.rollout.server``.

It builds its rollout engine outside the trainers' world, logs ``READY``, joins the weight-sync
transport of the trainers (rank ``num_trainer_ranks``; the secret comes in ``MEGATRON_GKD_ROLLOUT_SECRET``),
receives the weight-sync plan, and serves generate and weight-update requests over the transport's
control group until the trainers close it (:class:`~megatron_gkd.rollout.remote.RolloutServer`).
A trainer run starts it itself (``rollout.layout=disaggregated``); it stops with its parent.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from megatron_gkd import platform
from megatron_gkd.child_process import exit_with_parent
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.rollout.registry import ENGINES
from megatron_gkd.rollout.remote import RolloutServer
from megatron_gkd.weight_sync import TorchDistributedTransport, WeightReceiver, WeightSyncConfig, connect_rollout

logger = logging.getLogger(__name__)

SECRET_ENV = "MEGATRON_GKD_ROLLOUT_SECRET"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1", help="the trainers' weight-sync store (trainer rank 0)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num-trainer-ranks", type=int, required=True)
    parser.add_argument("--engine", default="vllm", help="registered rollout engine")
    parser.add_argument("--engine-kwargs", default="{}", help="JSON: the engine's keyword arguments")
    parser.add_argument("--weight-sync", default="{}", help="JSON: WeightSyncConfig fields")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="each operation of a sync")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process dies")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    setup_logging("INFO")

    platform.setup()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.exit_with_parent:
        exit_with_parent()
    engine = ENGINES.build(args.engine, join_world=False, **json.loads(args.engine_kwargs))
    logger.info("READY rollout server")  # the line the parent waits for (ServiceProcess reads the log)
    transport = None
    try:
        rank = args.num_trainer_ranks
        transport = TorchDistributedTransport(address=args.address, port=args.port, rank=rank,
                                              num_trainer_ranks=args.num_trainer_ranks, num_rollout_ranks=1,
                                              timeout_s=args.timeout_s, secret=os.environ.get(SECRET_ENV) or None)
        plan = connect_rollout(transport)
        receiver = WeightReceiver(plan, transport, WeightSyncConfig(**json.loads(args.weight_sync)))
        answered = RolloutServer(engine, transport.world, server_rank=rank, trainer_rank=0, receiver=receiver).serve()
        logger.info("rollout server done after %d requests", answered)
    finally:
        engine.close()
        if transport is not None:
            transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
