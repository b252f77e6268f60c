"""The ``optim`` section: the student's optimizer and learning-rate schedule (built by
:mod:`megatron_gkd.trainer.optim`; here, below both ``config/`` and ``trainer/``, because both need it)."""

from __future__ import annotations

import dataclasses

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
