"""The trainer's configuration: typed dataclass sections, YAML presets in ``configs/``, dotted overrides.

    config = load_config("configs/demo_cpu.yaml", ["loss.type=tcad", "rollout.n=8"])
    text = to_yaml(config)                # what config.yaml of a run holds

Unknown keys fail naming the closest valid key; inconsistent combinations fail with the fix.
"""

from megatron_gkd.config.checks import (
    check_layout,
    eval_enabled,
    needs_responses,
    needs_rollout,
    needs_teacher,
    student_samples,
)
from megatron_gkd.config.loading import load_config, merge_layers, replace, to_dict, to_yaml
from megatron_gkd.config.schema import (
    CheckpointConfig,
    EvalConfig,
    GKDConfig,
    LoggingConfig,
    LossConfig,
    RolloutConfig,
    StudentConfig,
    TrainerConfig,
)

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "GKDConfig",
    "LoggingConfig",
    "LossConfig",
    "RolloutConfig",
    "StudentConfig",
    "TrainerConfig",
    "check_layout",
    "eval_enabled",
    "load_config",
    "merge_layers",
    "needs_responses",
    "needs_rollout",
    "student_samples",
    "needs_teacher",
    "replace",
    "to_dict",
    "to_yaml",
]
