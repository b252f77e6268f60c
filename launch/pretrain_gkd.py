"""Distillation entry point (the logic is :mod:`megatron_gkd.trainer.cli`, also ``python -m megatron_gkd.trainer.cli``).

    torchrun --nproc_per_node N launch/pretrain_gkd.py --config configs/X.yaml [section.key=value ...]
    python launch/pretrain_gkd.py --config configs/X.yaml --print-config        # the resolved config
    python launch/pretrain_gkd.py --config configs/X.yaml --dry-run --world-size 16   # validate + layout plan
"""

import sys

from megatron_gkd.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
