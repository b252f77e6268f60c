"""A registry of implementations named ``"module:Class"``, imported only when built.

Teacher backends and clients use it so that heavy dependencies (vLLM, Megatron-Core) are imported only
when their implementation is chosen.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyRegistry:
    """Maps a name to ``"module:Class"``; :meth:`build` imports the class and instantiates it."""

    def __init__(self, kind: str, targets: dict[str, str]):
        self._kind = kind
        self._targets = dict(targets)

    def register(self, name: str, target: str) -> None:
        self._targets[name] = target

    def names(self) -> list[str]:
        return sorted(self._targets)

    def build(self, name: str, **kwargs: Any) -> Any:
        """Instantiates ``name`` with ``kwargs``.

        Raises:
            ValueError: ``name`` is not registered (the message lists the registered names).
        """
        if name not in self._targets:
            raise ValueError(f"{self._kind} {name!r} is unknown; choose one of {self.names()}")
        module_name, class_name = self._targets[name].split(":")
        return getattr(importlib.import_module(module_name), class_name)(**kwargs)
