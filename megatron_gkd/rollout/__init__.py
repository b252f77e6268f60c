"""Rollout: the student samples its own responses (DESIGN.md, step 1).

Public API::

    from megatron_gkd.rollout import SamplingConfig, build_engine
    engine = build_engine("vllm", model=hf_dir, layout="colocated", tensor_parallel_size=2)
    batch = engine.generate(prompt_token_ids, SamplingConfig(n=4, max_tokens=128, logprobs_k=8))
    engine.load_weights(named_hf_tensors, version=step)       # vLLM engines: weight sync lands here

Engines (registry, :func:`build_engine`): ``vllm`` (layouts ``colocated`` and ``disaggregated``) and
``megatron`` (the reference engine sampling with the Megatron student itself). vLLM is imported only
when a ``vllm`` engine is built.
"""

from megatron_gkd.rollout.registry import RolloutEngine, build_engine, register_engine, registered_engines
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig, check_prompt_lengths

# Engine modules register themselves on import; neither imports vLLM at module level.
from megatron_gkd.rollout import megatron_engine, vllm_engine  # noqa: E402,F401  isort: skip

__all__ = ["RolloutBatch", "RolloutEngine", "SamplingConfig", "build_engine", "check_prompt_lengths",
           "register_engine", "registered_engines"]
