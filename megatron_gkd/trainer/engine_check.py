"""Whether the rollout engine samples with the weights the trainer trains: the cheap check that is always on.

A weight sync can reach the engine and still leave it serving other weights: vLLM 0.32 kept a tied head's first
weights for a whole run and only warned (``megatron_gkd/weight_sync/reload_logs.py``), and the run went on, silently
off-policy. ``weight_sync.verify`` catches it but costs a prompt scoring by the engine and a forward of the student
at every sync, so it is off by default. This check costs almost nothing: every sampled token carries the engine's
own log-prob of it (``RolloutBatch.logprobs``, raw: temperature 1), and the step computes the trainer's at the same
position, in the divergence's pass over the logits where it can (one more column of the support gather), in a
no-grad pass of its own on the steps the check is due where it cannot (another signal, another tokenizer, another
temperature). Tokens sampled with the weights this update starts from (``SampledSlice.current``) must agree up to
the arithmetic of two implementations; the mean ``|log pi_train - log pi_engine|`` over them past
``weight_sync.check_tolerance`` stops the run with :class:`StaleRolloutEngine`.

Measured on this project's CPU runs (float32, vLLM and the hf engine against Megatron-Core): the mean is 1e-6 to
1e-5 nats per token. An engine that kept SmolLM2's head of one step earlier (lr 5e-5) was 2.1e-3 nats off at its
worst prompt token, and such an error grows with every step the engine misses. The float32 tolerance, 1e-3 nats,
lies between. bf16 engines and trainers part by more (two bf16 matmul orders; figures of the field put the mean near
1e-3 and single tokens past 1 nat), so a bf16 student's default is 0.05 nats: a check for engines that stopped
taking weights, not for numerics; ``weight_sync.verify`` is the exact one.

``mismatch/*`` (``KL(engine || trainer)`` by k1 and k3, the largest ratios both ways) is logged in every run that
trains on sampled tokens, over all of them: with ``one_step_off`` and partial rollouts it includes the weights'
staleness, which the check leaves out.
"""

from __future__ import annotations

import math

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05}
"""Nats per token, by the student's dtype (the module docstring says why)."""


class StaleRolloutEngine(RuntimeError):
    """The rollout engine's log-probs of the tokens it sampled are not the trainer's: it serves other weights."""


def check_due(interval: int, index: int, *, first: bool) -> bool:
    """Whether training batch ``index`` computes the check where no pass of the loss gives it for free: the first
    batch this process trains (a start or a resume: the engine was just loaded) and every ``interval``-th."""
    return interval > 0 and (first or index % interval == 0)


def tolerance_of(config) -> float:
    """The run's ``weight_sync.check_tolerance``, or the default of the coarser of the student's and the engine's
    dtypes."""
    if config.weight_sync.check_tolerance is not None:
        return float(config.weight_sync.check_tolerance)
    dtypes = [dtype for dtype in (config.student.dtype, config.rollout.dtype) if dtype is not None]
    return max(DEFAULT_TOLERANCE.get(str(dtype), DEFAULT_TOLERANCE["bfloat16"]) for dtype in dtypes)


def metrics(stats: dict) -> dict:
    """The step's ``mismatch/*`` (over every sampled token) and ``engine/*`` (over the tokens sampled with the
    weights being trained) figures from its summed statistics; empty where the step did not compare."""
    found = {}
    tokens = stats.get("mismatch/tokens", 0.0)
    if tokens > 0:
        found.update({"mismatch/kl_k1": stats["mismatch/k1"] / tokens, "mismatch/kl_k3": stats["mismatch/k3"] / tokens,
                      "mismatch/max_ratio": stats["mismatch/max_ratio"],
                      "mismatch/max_inverse_ratio": stats["mismatch/max_inverse_ratio"]})
    current = stats.get("engine/tokens", 0.0)
    if current > 0:
        found.update({"engine/tokens": current, "engine/mean_abs_error": stats["engine/abs"] / current,
                      "engine/max_abs_error": stats["engine/max_abs"]})
    return found


def check(figures: dict, *, tolerance: float, step: int) -> None:
    """Raises :class:`StaleRolloutEngine` when the step's ``engine/mean_abs_error`` (from :func:`metrics`) is past
    ``tolerance`` or not finite; nothing when the step compared no token. The trainer calls it with the step's
    logged figures, which every rank holds: every rank stops, and no checkpoint holds the step."""
    error = figures.get("engine/mean_abs_error")
    if error is None or error <= tolerance:
        return
    worst = figures["engine/max_abs_error"]
    raise StaleRolloutEngine(
        f"at step {step}, the rollout engine's log-probs of {int(figures['engine/tokens'])} tokens it sampled with "
        f"weight version {step - 1} differ from the trainer's by {error:.3g} nats on average (worst token "
        f"{worst:.3g}; weight_sync.check_tolerance={tolerance:g}): the engine is not running the trained weights, and "
        "the run would train off-policy. Run with weight_sync.verify=true to see which sync leaves it stale (it "
        "compares prompt log-probs after every sync); a log line 'vLLM's reload left weights out' names the layers"
        if math.isfinite(error) else
        f"at step {step}, the rollout engine's log-probs of the tokens it sampled are not finite against the "
        f"trainer's ({error}): the engine or the trainer computes garbage")
