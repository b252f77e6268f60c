"""Model-parallel runtime: initialisation, the explicit group collection, shard helpers."""

from megatron_gkd.parallel.schedules import eval_mode, forward_logits, run_schedule
from megatron_gkd.parallel.shards import gather_tp, merge_shards, scatter_tp, shard_for_rank
from megatron_gkd.parallel.state import (
    ParallelConfig,
    ParallelState,
    destroy,
    get_state,
    initialize,
    seed,
)

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "destroy",
    "eval_mode",
    "forward_logits",
    "gather_tp",
    "get_state",
    "initialize",
    "merge_shards",
    "run_schedule",
    "scatter_tp",
    "seed",
    "shard_for_rank",
]
