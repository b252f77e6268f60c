"""MoE routing statistics (:class:`~megatron_gkd.trainer.routing.RoutingStats`) leave padding out.

A micro-batch padded further (as expert parallelism across data-parallel ranks, or sequence parallelism, pads
it) gives the same load-balancing loss and expert load as unpadded when the trainer passes its padding mask to
the router; without the mask the padding is routed and counted, which is what made those figures depend on
the layout. One process, a tiny random Qwen3-MoE; default tier (seconds).
"""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint

pytestmark = pytest.mark.distributed


def _routing(path):
    import torch.distributed as dist

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.trainer.routing import RoutingStats

    parallel.initialize()
    try:
        [model] = load_hf(path)
        model.train()
        stats = RoutingStats([model], dist.group.WORLD, data_parallel_size=1)
        tokens = torch.tensor([[3, 17, 42, 9, 100, 5]])
        padded = torch.cat([tokens, torch.zeros(1, 4, dtype=torch.int64)], dim=1)
        mask = torch.arange(padded.shape[1])[None] >= tokens.shape[1]
        results = {}
        for name, (ids, padding) in {"plain": (tokens, None), "masked": (padded, mask), "unmasked": (padded, None)}.items():
            positions = torch.arange(ids.shape[1])[None]
            model(ids, positions, attention_mask=None, **({} if padding is None else {"padding_mask": padding}))
            results[name] = stats.collect(num_microbatches=1)
        return results
    finally:
        parallel.destroy()


def test_padding_is_left_out_of_the_load_balancing_loss_and_the_expert_load(tmp_path):
    path = make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe", seed=3, router_aux_loss_coef=0.01)
    [results] = run_distributed(_routing, 1, args=(path,))
    plain, masked, unmasked = results["plain"], results["masked"], results["unmasked"]
    assert plain["moe/tokens_routed"] == 6 and unmasked["moe/tokens_routed"] == 10
    assert {k for k in plain if k.startswith("moe/layer")} == {f"moe/layer{layer}/{name}" for layer in (0, 2, 3) for name in (
        "expert_load_max", "expert_load_min", "expert_load_imbalance", "load_balancing_loss")}  # layer 1 is dense
    for key, value in plain.items():
        assert masked[key] == pytest.approx(value, rel=1e-6), key
    assert unmasked["moe/load_balancing_loss"] != pytest.approx(plain["moe/load_balancing_loss"], rel=1e-6)
    assert plain["moe/dropped_tokens"] == 0
