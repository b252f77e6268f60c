"""The student's optimizer: Megatron's DDP wrapper, Megatron's optimizer and its LR schedule.

Three builders for the ``optim`` section (:class:`~megatron_gkd.config.optim.OptimizerConfig`), used by
the trainer, the tests and the benchmarks alike::

    chunks = wrap_for_training(chunks, config)            # Megatron DistributedDataParallel per chunk
    optimizer = build_optimizer(config, chunks, dtype=torch.bfloat16)
    scheduler = build_lr_scheduler(config, optimizer, num_steps=1000)
"""

from __future__ import annotations

import torch

from megatron_gkd.config.optim import OptimizerConfig
from megatron_gkd.models import embedding_grad


def wrap_for_training(chunks: list[torch.nn.Module], config: OptimizerConfig) -> list[torch.nn.Module]:
    """Wraps each chunk in Megatron's ``DistributedDataParallel`` (fp32 gradient buffers).

    Only the first chunk buckets its gradients: with virtual pipeline stages the other chunks' grads
    are reduced once at the end, as Megatron's own training script does. The word embeddings then add their gradient
    into the buffer row by row (``models.embedding_grad``).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    embedding_grad.install()

    # Gradients are reduced after the backward, never overlapped with it: the fused loss and the word embedding add
    # their gradient into ``main_grad`` themselves and return none (``losses.shard_ops.WeightGrad``,
    # ``models.embedding_grad``), so DDP's per-parameter hook, which an overlapped reduction waits for, may not run
    # for those weights.
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=config.use_distributed_optimizer,
        overlap_grad_reduce=False,
    )
    return [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


def build_optimizer(config: OptimizerConfig, chunks: list[torch.nn.Module], *, dtype: torch.dtype = torch.float32):
    """Megatron's optimizer over DDP-wrapped ``chunks`` (fp32 main parameters for bf16/fp16 models)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    megatron_config = MegatronOptimizerConfig(
        optimizer=config.optimizer,
        lr=config.lr,
        min_lr=config.min_lr,  # read from the param groups by the scheduler's decay
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(megatron_config, chunks)
    fuse_host_adam(optimizer)
    return optimizer


def fuse_host_adam(optimizer) -> None:
    """Switches each torch Adam/AdamW under ``optimizer`` whose parameters are on the host to torch's fused kernel.

    Without Apex or Transformer Engine, Megatron steps a plain ``torch.optim.AdamW``, which on the host loops over
    each tensor several times (``_single_tensor_adam``). The fused kernel makes one vectorised pass: the same update
    to float32 rounding (1.2e-7 after 5 steps) in a third of the time (0.12 against 0.39 s a step for 0.2B
    parameters on the 2-core machine; docs/performance.md). Groups on an accelerator are left to Megatron's choice.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if group["params"] and all(param.device.type == "cpu" for param in group["params"]):
                group["fused"], group["foreach"] = True, False


def build_lr_scheduler(config: OptimizerConfig, optimizer, num_steps: int):
    """Megatron's ``OptimizerParamScheduler``: warm-up then decay, advanced once per optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = config.lr_decay_steps or max(num_steps, config.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
