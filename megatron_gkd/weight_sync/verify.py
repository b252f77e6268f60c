"""The ``verify`` option: after a sync, vLLM's prompt log-probs must equal the student's own forward."""

from __future__ import annotations

import torch

from megatron_gkd.parallel import forward_logits
from megatron_gkd.weight_sync.errors import WeightSyncError


class WeightSyncMismatch(WeightSyncError):
    """vLLM does not compute what the student computes after a sync."""


def vllm_prompt_logprobs(llm, prompts) -> torch.Tensor:
    """Log-probs ``[sum(len(p) - 1)]`` (float64) that vLLM gives each prompt token after the first."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    values = []
    for output, prompt in zip(outputs, prompts):
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            values.append(entry[prompt[position]].logprob)
    return torch.tensor(values, dtype=torch.float64)


def student_prompt_logprobs(chunks, prompts) -> torch.Tensor | None:
    """The same log-probs from the Megatron student (collective; the result on the last stage, else ``None``)."""
    values = []
    for prompt in prompts:
        tokens = torch.tensor([list(prompt)])
        logits = forward_logits(chunks, tokens)  # [1, s, v] on the last stage
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits[0, :-1].double(), dim=-1)
        values.append(logprobs.gather(-1, tokens[0, 1:, None].to(logprobs.device))[:, 0].cpu())  # vLLM's are host
    return torch.cat(values) if values else None


def check_prompt_logprobs(got: torch.Tensor, expected: torch.Tensor, tolerance: float, version: int, *,
                          mean: bool = False) -> float:
    """Raises :class:`WeightSyncMismatch` when they differ by more than ``tolerance`` (at the worst token, or on
    average with ``mean``: the periodic engine check, ``weight_sync.check_interval``); returns the error."""
    differences = (got - expected).abs()
    error = (differences.mean() if mean else differences.max()).item()
    if not error <= tolerance:
        raise WeightSyncMismatch(
            f"after weight sync to version {version}, the rollout engine's prompt log-probs differ from the student's "
            f"by {error:.3e}{' on average' if mean else ''} (> {tolerance:.1e}): the engine is not running the "
            "trained weights"
        )
    return error


def verification(config, check: float | None) -> tuple[float, bool] | None:
    """What a sync verifies: ``(tolerance, mean)``, or None. ``weight_sync.verify`` (every sync, the worst token
    within ``verify_tolerance``) wins over ``check`` (this sync is the periodic engine check: the mean within it)."""
    if config.verify:
        return config.verify_tolerance, False
    return None if check is None else (check, True)
