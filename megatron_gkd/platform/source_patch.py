"""Literal rewrites of single Megatron-Core functions, checked against the pinned source.

Some CUDA assumptions in Megatron-Core are not calls but literals inside long functions, e.g.
``assert param.grad.type() == 'torch.cuda.FloatTensor'``. Copying those functions into this project
would fork Megatron; wrapping them cannot reach the literal. A :class:`SourceRewrite` instead reads the
installed function's source, replaces exact text fragments, and compiles the result in the function's
own module namespace. Every fragment must occur in the source exactly as written, otherwise applying
the rewrite fails loudly: a Megatron-Core release that changed the function is never patched blindly.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from types import FunctionType, ModuleType


@dataclasses.dataclass(frozen=True)
class SourceRewrite:
    """Replace text fragments inside one function (or method) of a Megatron-Core module.

    Attributes:
        qualname: ``function`` or ``Class.method`` inside the module.
        replacements: ``(old, new)`` pairs; each ``old`` must occur in the function's source.
    """

    qualname: str
    replacements: tuple[tuple[str, str], ...]

    def apply(self, module: ModuleType) -> None:
        owner, attr = _resolve_owner(module, self.qualname)
        original = owner.__dict__[attr] if owner is not module else getattr(module, attr)
        descriptor = type(original) if isinstance(original, (staticmethod, classmethod)) else None
        if descriptor is not None:
            original = original.__func__
        source = textwrap.dedent(inspect.getsource(original))
        for old, new in self.replacements:
            if old not in source:
                raise RuntimeError(
                    f"CPU adaptor: expected text {old!r} not found in "
                    f"{module.__name__}.{self.qualname}; this Megatron-Core version is not the one "
                    "the adaptor was verified against"
                )
            source = source.replace(old, new)
        owner_is_class = owner is not module
        compiled = _compile(source, original, module, owner if owner_is_class else None)
        if descriptor is not None and not isinstance(compiled, descriptor):
            # An explicit decorator is part of the source; ``__new__`` is a staticmethod implicitly.
            compiled = descriptor(compiled)
        setattr(owner, attr, compiled)


def _resolve_owner(module: ModuleType, qualname: str):
    parts = qualname.split(".")
    owner = module
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _compile(source: str, original: FunctionType, module: ModuleType, cls):
    # Methods that call zero-argument super() need a `__class__` cell: compile the function nested in
    # a factory whose argument is named `__class__`, which the compiler then closes over.
    name = original.__name__
    factory_src = "def _make(__class__):\n" + textwrap.indent(source, "    ") + f"\n    return {name}\n"
    filename = f"<megatron_gkd source rewrite of {module.__name__}.{original.__qualname__}>"
    namespace: dict = {}
    exec(compile(factory_src, filename, "exec"), module.__dict__, namespace)  # noqa: S102
    result = namespace["_make"](cls)
    function = result.__func__ if isinstance(result, (staticmethod, classmethod)) else result
    function.__qualname__ = original.__qualname__
    function.__module__ = original.__module__
    function.__megatron_gkd_rewritten__ = True
    return result
