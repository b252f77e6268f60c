"""The student's optimizer: Megatron's DDP wrapper, Megatron's optimizer and its LR schedule.

One configuration section (``optim``) and three builders, used by the trainer, the tests and the
benchmarks alike::

    chunks = wrap_for_training(chunks, config)            # Megatron DistributedDataParallel per chunk
    optimizer = build_optimizer(config, chunks, dtype=torch.bfloat16)
    scheduler = build_lr_scheduler(config, optimizer, num_steps=1000)
"""

from __future__ import annotations

import dataclasses

import torch

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
OPTIMIZERS = ("adam", "sgd")


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule of the student."""

    optimizer: str = "adam"
    """``adam`` (AdamW-style decoupled weight decay, as Megatron's) or ``sgd``."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables it)."""
    lr_warmup_steps: int = 0
    """Linear warm-up from ``lr_warmup_init`` to ``lr`` over this many steps."""
    lr_warmup_init: float = 0.0
    lr_decay_style: str = "constant"
    """After the warm-up: ``constant``, ``linear``, ``cosine`` or ``inverse-square-root`` down to ``min_lr``."""
    lr_decay_steps: int | None = None
    """Steps of the decay including the warm-up; ``None``: the run's number of steps."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optim.optimizer={self.optimizer!r}; choose one of {list(OPTIMIZERS)}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r}; choose one of {list(DECAY_STYLES)}")
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} must lie in [0, optim.lr={self.lr}]")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"optim.lr_warmup_init={self.lr_warmup_init} must lie in [0, optim.lr={self.lr}]")
        for name in ("weight_decay", "clip_grad", "lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1 and self.adam_eps > 0):
            raise ValueError("optim.adam_beta1/adam_beta2 must lie in [0, 1) and optim.adam_eps must be > 0")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(f"optim.lr_decay_steps={self.lr_decay_steps} must exceed optim.lr_warmup_steps="
                             f"{self.lr_warmup_steps} (the decay steps include the warm-up); or set it to null")


def wrap_for_training(chunks: list[torch.nn.Module], config: OptimizerConfig) -> list[torch.nn.Module]:
    """Wraps each chunk in Megatron's ``DistributedDataParallel`` (fp32 gradient buffers).

    Only the first chunk buckets its gradients: with virtual pipeline stages the other chunks' grads
    are reduced once at the end, as Megatron's own training script does.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=config.use_distributed_optimizer
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
    return get_megatron_optimizer(megatron_config, chunks)


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
