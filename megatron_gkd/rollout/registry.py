"""Rollout engines registered by name and chosen by a config string.

``build_engine("vllm", model=...)``, ``build_engine("hf", model=...)`` or ``build_engine("megatron", chunks=...)``.
Every engine implements :class:`~megatron_gkd.rollout.engine.RolloutEngine`. An engine on a rollout server (the
disaggregated layout) is built there by :func:`megatron_gkd.rollout.remote.build_disaggregated`, around the engine
this registry builds, so engine modules never import one another.
"""

from __future__ import annotations

import dataclasses

from megatron_gkd.registry import Registry
from megatron_gkd.rollout.engine import RolloutEngine


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTraits:
    """What a rollout engine needs, declared where it is registered, so the config's checks, the planner and the
    builders ask ``engine_traits(name)`` without importing the engine (vLLM) or comparing its name."""

    shares_student_weights: bool = False
    """The engine samples with the student's own parameters (its class's ``shares_student_weights``): nothing is
    sent, it needs the colocated layout and one pipeline stage, and it is built on the student's chunks. Otherwise
    the engine has weights (and an implementation) of its own: weights are synced to it, its TP may differ from
    training's, and its log-probs differ from the student's in low precision."""

    tensor_parallel: bool = True
    """The engine can split its model over ``rollout.tensor_parallel_size`` ranks. Otherwise every rank holds the whole
    model (``rollout.tensor_parallel_size`` must be 1) and is one replica of the colocated layout."""

    serves_remote: bool = True
    """The engine can run on a rollout server (``rollout.layout=disaggregated``)."""

    vllm_options: bool = False
    """The engine is built with vLLM's serving options (``max_logprobs``, an engine seed, a tokenizer-free start, and
    the memory it reserves: ``rollout.gpu_memory_utilization`` / ``rollout.kv_cache_memory_mb``, inert otherwise)."""

    releases_weights: bool = False
    """The colocated engine can keep no weights of its own between syncs (``rollout.release_weights``; the engine's
    ``release_weights`` argument): it reads the student's tensors in place and drops them while the trainer updates."""


ENGINES: Registry = Registry("rollout engine", config_key="rollout.engine", traits=EngineTraits)


def register_engine(name: str, target=None, traits: EngineTraits | None = None):
    """Registers an engine class or factory (or a lazy ``"module:attribute"``) under ``name`` with its traits."""
    return ENGINES.register(name, target, traits=traits)


def engine_traits(name: str) -> EngineTraits:
    """The traits of the engine registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered (naming the closest).
    """
    return ENGINES.traits(name)


register_engine("vllm", "megatron_gkd.rollout.vllm_engine:VLLMEngine", EngineTraits(vllm_options=True))
register_engine("hf", "megatron_gkd.rollout.hf_engine:HFEngine", EngineTraits(tensor_parallel=False, serves_remote=False,
                                                                                  releases_weights=True))
register_engine("megatron", "megatron_gkd.rollout.megatron_engine:MegatronEngine", EngineTraits(shares_student_weights=True))


def build_engine(name: str, **kwargs) -> RolloutEngine:
    """Builds the engine registered as ``name`` in this process (its shard of it: the colocated layout). An engine
    on a rollout server is built by :func:`megatron_gkd.rollout.remote.build_disaggregated`.

    Raises:
        ValueError: ``name`` is not registered (the message lists the choices).
    """
    return ENGINES.build(name, **kwargs)


def registered_engines() -> list[str]:
    return ENGINES.names()
