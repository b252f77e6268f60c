"""The project's one registry helper: lazy targets, did-you-mean, no silent overwrite."""

import sys

import pytest

from megatron_gkd.registry import Registry


def test_lazy_target_is_imported_only_when_chosen():
    registry = Registry("thing", config_key="x.thing")
    registry.register("decoder", "json.decoder:JSONDecoder")
    sys.modules.pop("fractions", None)
    registry.register("fraction", "fractions:Fraction")
    assert "fractions" not in sys.modules
    assert registry.build("fraction", numerator=3, denominator=6) == 0.5
    assert "fractions" in sys.modules
    assert registry.names() == ["decoder", "fraction"] and "decoder" in registry


def test_unknown_name_names_the_key_and_the_closest_one():
    registry = Registry("rollout engine", config_key="rollout.engine")
    registry.register("vllm", object)
    registry.register("megatron", object)
    with pytest.raises(ValueError, match=r"rollout.engine='vlm'; did you mean 'vllm'\? \(registered: 'megatron', 'vllm'\)"):
        registry.get("vlm")


def test_registering_a_name_twice_fails_and_keeps_the_first():
    registry = Registry("divergence")

    @registry.register("kl")
    def first():
        return 1

    with pytest.raises(ValueError, match="already registered"):
        registry.register("kl", lambda: 2)
    assert registry.get("kl") is first
    with pytest.raises(ValueError, match="module:attribute"):
        registry.register("bad", "no_colon_here")


def test_project_registries_share_the_helper():
    from megatron_gkd.losses.registry import DIVERGENCES
    from megatron_gkd.models.registry import ARCHITECTURES
    from megatron_gkd.rollout import ENGINES
    from megatron_gkd.teacher.backends import BACKENDS
    from megatron_gkd.teacher.clients import CLIENTS
    from megatron_gkd.weight_sync.transports import TRANSPORTS

    for registry in (DIVERGENCES, ARCHITECTURES, ENGINES, BACKENDS, CLIENTS, TRANSPORTS):
        assert isinstance(registry, Registry) and registry.names()


def test_a_registry_keeps_each_entry_s_traits_beside_it():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Traits:
        fast: bool = False

    registry = Registry("rollout engine", config_key="rollout.engine", traits=Traits)
    registry.register("vllm", "package.module:Engine", traits=Traits(fast=True))  # lazy: never imported below

    @registry.register("hf")
    class HF:
        pass

    assert registry.traits("vllm") == Traits(fast=True) and registry.traits("hf") == Traits()
    assert registry.all_traits() == {"hf": Traits(), "vllm": Traits(fast=True)}
    with pytest.raises(ValueError, match=r"rollout.engine='vlm'; did you mean 'vllm'\?"):
        registry.traits("vlm")
    with pytest.raises(TypeError, match="traits must be a Traits"):
        registry.register("other", HF, traits={"fast": True})
    registry.unregister("hf")
    assert registry.names() == ["vllm"] and list(registry.all_traits()) == ["vllm"]
    with pytest.raises(TypeError, match="keeps no traits"):
        Registry("divergence").register("kl", HF, traits=Traits())
