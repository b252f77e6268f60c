"""MoE routing statistics of a training step: the load-balancing loss and the load of every expert, per layer.

Megatron's routers add the load-balancing (aux) loss to the gradient and record its value per layer in
Megatron's aux-loss tracker; this module reads that tracker once per step and also counts, with a forward
hook on each router, how many tokens every expert was given. Padding positions (``MicroBatch.padding_mask``)
are left out of both, so the figures do not depend on the layout. Tokens are counted in training forwards
only (grad enabled: not in eval, and once under activation recompute, whose first forward runs without grad).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gkd.models import unwrap


class RoutingStats:
    """Counts routed tokens per layer and expert on this rank, and reports a step's MoE metrics.

    Args:
        chunks: this rank's model chunks of an MoE model (hooks go on every router in them).
        group: a group over every rank (gloo). Each token is routed on one rank of a (sequence-parallel) TP
            group, one data-parallel rank and one pipeline stage per layer, so counts are summed over all ranks;
            so are Megatron's per-rank aux-loss values, which are partial sums over the TP x CP group.
        data_parallel_size: the aux loss is averaged over data-parallel ranks.
    """

    def __init__(self, chunks, group, *, data_parallel_size: int):
        from megatron.core.transformer.moe.router import TopKRouter

        config = unwrap(chunks[0]).config
        assert config.num_moe_experts, "RoutingStats needs an MoE model"
        self.group, self.data_parallel_size = group, data_parallel_size
        self.num_layers, self.num_experts, self.topk = config.num_layers, config.num_moe_experts, config.moe_router_topk
        # Without sequence parallelism every TP rank routes the same tokens (MoE at TP > 1 needs it in Megatron).
        self.replicas = 1 if config.sequence_parallel else config.tensor_model_parallel_size
        routers = [module for chunk in chunks for module in unwrap(chunk).modules() if isinstance(module, TopKRouter)]
        self._tokens = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self._valid = torch.zeros(self.num_layers, dtype=torch.float64)
        self._handles = [router.register_forward_hook(self._count, with_kwargs=True) for router in routers]

    def _count(self, router, args, kwargs, output) -> None:
        if not torch.is_grad_enabled():
            return
        _, routing_map = output  # [tokens, experts], after any capacity dropping
        padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        valid = torch.ones(routing_map.shape[0], dtype=torch.bool, device=routing_map.device) if padding is None \
            else ~padding.reshape(-1).to(torch.bool)
        layer = router.layer_number - 1
        self._tokens[layer] += (routing_map & valid[:, None]).sum(0).to("cpu", torch.float64)
        self._valid[layer] += float(valid.sum())

    def collect(self, num_microbatches: int) -> dict[str, float]:
        """The step's ``moe/*`` metrics (collective over ``group``: every rank calls it), then resets the counts
        and Megatron's aux-loss tracker.

        Per MoE layer ``L``: ``moe/layer{L}/load_balancing_loss`` (Megatron's aux loss without its coefficient,
        the mean over micro-batches), ``moe/layer{L}/expert_load_max`` / ``_min`` (tokens routed to the most and
        least loaded expert), ``moe/layer{L}/expert_load_imbalance`` (max / mean: 1 is perfectly balanced), and
        over layers ``moe/load_balancing_loss`` (mean), ``moe/expert_load_imbalance`` (max), ``moe/tokens_routed``
        and ``moe/dropped_tokens`` (token-expert assignments the capacity factor dropped; 0 without one).
        """
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        aux = torch.zeros(self.num_layers, dtype=torch.float64)
        if tracker is not None:  # this rank's sum over its micro-batches, per layer (zero on other stages' layers)
            # Megatron's tracker also has rows for multi-token-prediction layers after the decoder's.
            aux += tracker["values"][: self.num_layers].detach().to("cpu", torch.float64) / num_microbatches
            clear_aux_losses_tracker()
        has_aux = torch.tensor([float(tracker is not None)], dtype=torch.float64)
        counts = torch.cat([self._tokens.flatten(), self._valid, aux, has_aux])
        dist.all_reduce(counts, group=self.group)
        self._tokens.zero_()
        self._valid.zero_()
        size = self._tokens.numel()
        tokens = counts[:size].view(self.num_layers, self.num_experts) / self.replicas
        valid = counts[size : size + self.num_layers] / self.replicas
        aux = counts[size + self.num_layers : -1] / self.data_parallel_size if counts[-1] > 0 else None
        metrics: dict[str, float] = {}
        layers = [layer for layer in range(self.num_layers) if valid[layer] > 0]
        for layer in layers:
            load = tokens[layer]
            prefix = f"moe/layer{layer}"
            metrics[f"{prefix}/expert_load_max"] = float(load.max())
            metrics[f"{prefix}/expert_load_min"] = float(load.min())
            metrics[f"{prefix}/expert_load_imbalance"] = float(load.max() / load.mean().clamp_min(1e-30))
            if aux is not None:
                metrics[f"{prefix}/load_balancing_loss"] = float(aux[layer])
        if layers:
            metrics["moe/expert_load_imbalance"] = max(metrics[f"moe/layer{layer}/expert_load_imbalance"] for layer in layers)
            metrics["moe/tokens_routed"] = float(valid[layers[0]])
            metrics["moe/dropped_tokens"] = float(sum(self.topk * valid[layer] - tokens[layer].sum() for layer in layers))
            if aux is not None:
                metrics["moe/load_balancing_loss"] = float(aux[layers].mean())
        return metrics

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
