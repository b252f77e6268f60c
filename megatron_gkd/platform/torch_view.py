"""The ``torch`` module as Megatron-Core's modules see it on the CPU platform.

Megatron-Core writes ``torch.zeros(..., device="cuda")`` and ``torch.cuda.current_device()`` in
hundreds of places. Rather than patching each call site, the CPU adaptor replaces the global name
``torch`` inside every ``megatron.core`` module with :data:`TORCH_VIEW`: a module object that forwards
every attribute to the real ``torch`` except

* ``cuda``: the host stand-in :data:`~megatron_gkd.platform.host_cuda.HOST_CUDA`;
* tensor factories (``zeros``, ``tensor``, ``arange`` ...): wrappers that map a CUDA ``device``
  argument (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")`` or a bare ordinal) to the host and drop
  ``pin_memory`` (host-to-host copies need no pinned staging).

The view is visible only to Megatron-Core: the real ``torch`` module, and so vLLM, transformers and our
own code in the same process, is unchanged.
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_gkd.platform.host_cuda import HOST_CUDA, HOST_DEVICE

_FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "empty",
        "empty_like",
        "empty_strided",
        "eye",
        "full",
        "full_like",
        "linspace",
        "ones",
        "ones_like",
        "rand",
        "rand_like",
        "randint",
        "randn",
        "randn_like",
        "randperm",
        "tensor",
        "zeros",
        "zeros_like",
    }
)


def to_host_device(device):
    """Maps a CUDA device specification to the host; anything else is returned unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return HOST_DEVICE  # a bare ordinal names a CUDA device
    if isinstance(device, str) and device.startswith("cuda"):
        return HOST_DEVICE
    if isinstance(device, torch.device) and device.type == "cuda":
        return HOST_DEVICE
    return device


def _host_factory(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = to_host_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class _TorchView(types.ModuleType):
    def __init__(self):
        super().__init__("torch")
        self.cuda = HOST_CUDA
        for name in _FACTORIES:
            setattr(self, name, _host_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


TORCH_VIEW = _TorchView()
