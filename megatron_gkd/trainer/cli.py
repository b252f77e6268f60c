"""Distillation entry point: ``launch/pretrain_gkd.py`` (or ``python -m megatron_gkd.trainer.cli``).

    torchrun --nproc_per_node N launch/pretrain_gkd.py --config configs/X.yaml [section.key=value ...]
    python launch/pretrain_gkd.py --config configs/X.yaml --print-config        # the resolved config
    python launch/pretrain_gkd.py --config configs/X.yaml --dry-run --world-size 16   # validate + layout plan

A bad config exits with status 2 and one line naming the key and the fix. SIGTERM / SIGUSR1 (Slurm
preemption) make the run checkpoint after the current step and exit 0; rerunning the same command
resumes from the run directory. So does torchrun when a rank dies, given ``--max-restarts N`` and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in its environment (docs/running.md, "A rank that dies").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_gkd import platform
from megatron_gkd.config import load_config, to_yaml
from megatron_gkd.config.dry_run import layout_plan
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.trainer import run_dir
from megatron_gkd.trainer.checks import check_registered_names
from megatron_gkd.trainer.loop import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML preset (see configs/); omitted: the schema's defaults")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides, e.g. rollout.n=8")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true", help="validate the config, print the rank/layout plan, exit")
    parser.add_argument("--world-size", type=int, help="world size of the dry run (default: $WORLD_SIZE or TP x PP)")
    parser.add_argument("--resume", action="store_true",
                        help="require resuming from the run directory's checkpoints (default: resume if there are any)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    overrides = list(args.overrides)
    try:
        config = load_config(args.config, overrides)
        check_registered_names(config)
        if args.resume:
            config.checkpoint.resume = str(run_dir.checkpoints(config.trainer.output_dir))
    except ValueError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(config), end="")
        return 0
    if args.dry_run:
        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "0")) or None
        try:
            print(layout_plan(config, world_size))
        except ValueError as error:
            print(f"config error: {error}", file=sys.stderr)
            return 2
        return 0
    setup_logging(config.logging.level, all_ranks=config.logging.all_ranks,
                  log_file=str(run_dir.train_log(config.trainer.output_dir)))

    platform.setup(mindspeed=config.mindspeed)  # MindSpeed (npu) reads its options as it is imported
    import torch.distributed as dist

    trainer = None
    try:
        trainer = Trainer(config)
        summary = trainer.train()
        if trainer.rank == 0:
            print("megatron-gkd summary: " + json.dumps(summary), flush=True)  # one line, for scripts
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
