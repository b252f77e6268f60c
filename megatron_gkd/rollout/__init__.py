"""Rollout: the student samples its own responses (docs/design.md, "One batch through one step").

Public API::

    from megatron_gkd.rollout import SamplingConfig, build_engine
    engine = build_engine("vllm", model=hf_dir, tensor_parallel_size=2)
    batch = engine.generate(prompt_token_ids, SamplingConfig(n=4, max_tokens=128, logprobs_k=8))
    engine.load_weights(named_hf_tensors, version=step)       # vLLM engines: weight sync lands here

Engines (registry, :func:`build_engine`): ``vllm``, ``hf`` (``transformers`` over its KV cache, one whole model per
rank, colocated only: small models on the CPU) and ``megatron`` (the reference engine sampling with the Megatron
student itself); ``vllm`` runs ``colocated`` or ``disaggregated`` (a serving rank and clients: :mod:`.remote`).
Engine modules are imported only when their engine is built, so vLLM loads only for ``vllm``.
"""

from megatron_gkd.rollout.engine import RolloutEngine, StaleWeightsError
from megatron_gkd.rollout.registry import (
    ENGINES,
    EngineTraits,
    build_engine,
    engine_traits,
    register_engine,
    registered_engines,
)
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig, check_prompt_lengths

__all__ = ["ENGINES", "EngineTraits", "RolloutBatch", "RolloutEngine", "SamplingConfig", "StaleWeightsError", "build_engine",
           "check_prompt_lengths", "engine_traits", "register_engine", "registered_engines"]
