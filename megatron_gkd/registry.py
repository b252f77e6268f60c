"""One registry helper for every "chosen by a config string" variant in the project.

Divergences, rollout engines, teacher backends and clients, model architectures, schedulers and eval
scorers are all :class:`Registry` instances. An entry is either the object itself or a lazy
``"module:attribute"`` target, imported only when that name is chosen, so heavy optional dependencies
(vLLM, Megatron-Core) load only for the implementation in use::

    ENGINES = Registry("rollout engine", config_key="rollout.engine")
    ENGINES.register("vllm", "megatron_gkd.rollout.vllm_engine:VLLMEngine")   # lazy

    @ENGINES.register("megatron")                                           # decorator
    class MegatronEngine: ...

    engine = ENGINES.build("vllm", model=path)       # ValueError naming the closest name if unknown

Registering a name twice is an error (a plugin must choose a new name): nothing is overwritten silently.

A registry built with ``traits=`` (a frozen dataclass of what an entry needs and can do) keeps each entry's
traits beside it, so code asks ``ENGINES.traits(name).vllm_options`` and never keeps a second table by name::

    ENGINES = Registry("rollout engine", config_key="rollout.engine", traits=EngineTraits)
    ENGINES.register("vllm", "megatron_gkd.rollout.vllm_engine:VLLMEngine", traits=EngineTraits(vllm_options=True))

A closed set of choices that code branches on (the teacher's signal, the rollout layout, the loss kind) is a
:class:`Choice`: its members say what each choice needs, so code asks ``signal.needs_head`` instead of comparing
a name (``tests/unit/test_code_habits.py`` keeps names from being compared outside their owners).
"""

from __future__ import annotations

import difflib
import enum
import importlib
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


def closest(name: str, choices: list[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices`` to ``name``, or ``""``."""
    match = difflib.get_close_matches(name, choices, n=1)
    return f"; did you mean {match[0]!r}?" if match else ""


class Registry(Generic[T]):
    """Names mapped to objects or to lazy ``"module:attribute"`` targets.

    Args:
        kind: what the entries are, for messages (e.g. ``"rollout engine"``).
        config_key: the config key that selects an entry (e.g. ``"rollout.engine"``), for messages.
        traits: the type of each entry's traits (a frozen dataclass whose defaults are an entry that needs nothing
            special); None: the entries have none.
    """

    def __init__(self, kind: str, config_key: str | None = None, traits: type | None = None):
        self.kind = kind
        self.config_key = config_key
        self._traits_type = traits
        self._entries: dict[str, T | str] = {}
        self._traits: dict[str, Any] = {}

    def register(self, name: str, target: T | str | None = None, *, traits: Any = None) -> Any:
        """Registers ``target`` (an object, or ``"module:attribute"``) under ``name``, with its ``traits`` (default:
        the traits type's defaults).

        Without ``target`` it returns a decorator that registers the decorated object.

        Raises:
            ValueError: ``name`` is already registered, or a lazy target is not ``module:attribute``.
            TypeError: ``traits`` for a registry without a traits type, or of another type.
        """
        if target is None:
            def decorate(obj: T) -> T:
                self.register(name, obj, traits=traits)
                return obj

            return decorate
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; register it under another name")
        if isinstance(target, str) and target.count(":") != 1:
            raise ValueError(f"lazy {self.kind} target {target!r} must look like 'package.module:attribute'")
        if self._traits_type is None and traits is not None:
            raise TypeError(f"the {self.kind} registry keeps no traits")
        if self._traits_type is not None:
            traits = self._traits_type() if traits is None else traits
            if not isinstance(traits, self._traits_type):
                raise TypeError(f"{self.kind} {name!r}: traits must be a {self._traits_type.__name__}, not "
                                f"{type(traits).__name__}")
            self._traits[name] = traits
        self._entries[name] = target
        return target

    def unregister(self, name: str) -> None:
        """Removes ``name`` and its traits (a test's temporary entry)."""
        del self._entries[name]
        self._traits.pop(name, None)

    def traits(self, name: str, *, config_key: str | None = None) -> Any:
        """The traits registered with ``name``, without importing its target.

        Raises:
            ValueError: ``name`` is not registered (naming the closest).
        """
        if name not in self._entries:
            raise self.unknown(name, config_key)
        return self._traits[name]

    def all_traits(self) -> dict[str, Any]:
        """``{name: traits}`` of every entry, sorted by name."""
        return {name: self._traits[name] for name in self.names()}

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def unknown(self, name: object, config_key: str | None = None) -> ValueError:
        """The error for an unknown ``name``: the key, the closest name and every registered one.

        ``config_key``: the key that chose it, where another key than the registry's own chooses from it too.
        """
        config_key = config_key or self.config_key
        where = f"{config_key}={name!r}" if config_key else repr(name)
        registered = ", ".join(repr(n) for n in self.names()) or "none"
        return ValueError(f"unknown {self.kind} {where}{closest(str(name), self.names())} (registered: {registered})")

    def get(self, name: str, *, config_key: str | None = None) -> T:
        """The object registered as ``name``, importing a lazy target on first use (``config_key``: as in
        :meth:`unknown`).

        Raises:
            ValueError: ``name`` is not registered.
            ImportError: a lazy target's module does not import (its message says what is missing).
        """
        if name not in self._entries:
            raise self.unknown(name, config_key)
        target = self._entries[name]
        if isinstance(target, str):
            module_name, attribute = target.split(":")
            target = getattr(importlib.import_module(module_name), attribute)
            self._entries[name] = target
        return target

    def build(self, name: str, /, **kwargs: Any) -> Any:
        """Calls the entry registered as ``name`` (a class or factory) with ``kwargs``."""
        factory: Callable[..., Any] = self.get(name)  # type: ignore[assignment]
        return factory(**kwargs)


class Choice(str, enum.Enum):
    """A closed set of config strings whose members say what each choice does.

    A member is its string (``Signal.HIDDEN == "hidden"``; ``str()``, ``repr()``, f-strings, YAML, JSON and
    msgpack give the value's), so a config field keeps its ``str`` type for OmegaConf, its messages and its dumps, and is
    converted once, where it is validated.
    """

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # messages say ``teacher.signal='hidden'``, as they did for the plain string
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's string, in definition order."""
        return tuple(member.value for member in cls)
