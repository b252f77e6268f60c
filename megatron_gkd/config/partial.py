"""Partial rollouts (``trainer.scheduler=partial``): generation in per-step token chunks that a weight update does
not stop. What the trainer does with them is :mod:`megatron_gkd.trainer.partial`; docs/running.md says how to turn
them on and what is refused."""

from __future__ import annotations

import dataclasses
import logging

from megatron_gkd.config.schedules import SCHEDULERS
from megatron_gkd.rollout.registry import engine_traits
from megatron_gkd.rollout.types import Layout

logger = logging.getLogger(__name__)

PARTIAL_SCHEDULERS = tuple(name for name in SCHEDULERS.names() if SCHEDULERS.get(name).partial)
"""The schedulers of partial rollouts: ``partial`` samples each batch just before its update; ``partial_one_step_off``
one update ahead, so the teacher scores it while the previous update runs (token staleness >= 1)."""


def partial_rollouts(config) -> bool:
    """``trainer.scheduler`` is one of partial rollouts' (:data:`PARTIAL_SCHEDULERS`)."""
    return config.trainer.schedule.partial


@dataclasses.dataclass(kw_only=True, slots=True)
class PartialRolloutConfig:
    """``rollout.partial``: read only with ``trainer.scheduler=partial`` (or ``partial_one_step_off``)."""

    chunk_tokens: int = 64
    """New tokens a sample may generate per round; an unfinished sample continues at a later round (the next step's
    with the new weights). Smaller: less waiting for long samples, more (cheaper) engine calls."""
    max_staleness: int | None = None
    """Response tokens sampled more than this many weight versions before the update that trains them are masked
    out of the loss (they stay in the context; counted in ``rollout/partial/masked_tokens``). ``None``: no mask (a
    token's staleness is then bounded by the rounds a sample takes, ``ceil(rollout.max_tokens / chunk_tokens)``,
    plus the steps a complete group waits)."""
    max_prompts_in_flight: int | None = None
    """Prompt groups the buffer holds at most (complete or not); a round admits new prompts only below it.
    ``None``: twice the prompts of a step."""

    def __post_init__(self):
        if self.chunk_tokens < 1:
            raise ValueError(f"rollout.partial.chunk_tokens={self.chunk_tokens} must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"rollout.partial.max_staleness={self.max_staleness} must be >= 0 (or null: no mask)")
        if self.max_prompts_in_flight is not None and self.max_prompts_in_flight < 1:
            raise ValueError(f"rollout.partial.max_prompts_in_flight={self.max_prompts_in_flight} must be >= 1 "
                             "(or null: twice the prompts of a step)")


def check_partial(config) -> None:
    """What partial rollouts do not support, refused by key (:data:`PARTIAL_SCHEDULERS`); a warning when
    ``rollout.partial`` is set without them.

    Raises:
        ValueError: naming the key that does not fit and the fix.
    """
    partial, rollout, trainer = config.rollout.partial, config.rollout, config.trainer
    if not partial_rollouts(config):
        if partial != PartialRolloutConfig():
            logger.warning("rollout.partial.* has no effect with trainer.scheduler=%s (partial rollouts only: %s)",
                           trainer.scheduler, ", ".join(PARTIAL_SCHEDULERS))
        return
    name = f"trainer.scheduler={trainer.scheduler}"
    refused = {
        "trainer.mode": (not trainer.run_mode.samples, f"trainer.mode={trainer.mode} samples nothing; partial rollouts "
                                                       "continue the student's samples: use trainer.mode=on_policy"),
        "rollout.layout": (not Layout(rollout.layout).in_trainer, f"rollout.layout={rollout.layout} is not supported "
                           f"with {name} (a rollout server would generate through updates, not in rounds between "
                           "them): use rollout.layout=colocated"),
        "rollout.engine": (engine_traits(rollout.engine).shares_student_weights, f"rollout.engine={rollout.engine} "
                           "samples with the student itself, which partial rollouts have not been tried on: use an "
                           "engine with weights of its own (rollout.engine=vllm)"),
        "sample_mix": (config.sample_mix.enabled, f"sample_mix (GKD's mixture) is not supported with {name}: turn "
                                                  "sample_mix off or use one_step_off"),
        "rl": (config.rl.enabled, f"rl (the policy-gradient term) is not supported with {name} yet (untested on "
                                  "samples of several weight versions): turn rl off"),
        "trainer.token_budget": (trainer.token_budget is not None, f"trainer.token_budget is not supported with {name}: "
                                                                    "set trainer.num_steps"),
        "loss.confidence_alpha": (config.loss.confidence_alpha is not None and partial.max_staleness is not None,
                                  "TCAD's confidence weights are not supported with rollout.partial.max_staleness: the "
                                  "weights share the step's loss between whole samples, and the bound drops part of a "
                                  "sample, so the rest would no longer sum to the step's loss; unset one of the two"),
    }
    for key, (bad, message) in refused.items():
        if bad:
            raise ValueError(f"{key}: {message}")
