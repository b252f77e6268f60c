"""A host stand-in for the ``torch.cuda`` namespace, seen only by Megatron-Core on the CPU platform.

Megatron-Core calls ``torch.cuda.current_device()``, streams, events, RNG states and memory
statistics unconditionally. On a CPU-only torch build every one of those raises. The CPU adaptor
gives Megatron's modules a ``torch`` whose ``cuda`` attribute is :data:`HOST_CUDA`: the same API,
answered by the host (``torch.cpu`` for streams and events, the default CPU generator for RNG).
Attributes not listed here fall through to the real ``torch.cuda`` so that type objects such as
``torch.cuda.FloatTensor`` still resolve and anything unsupported fails with torch's own error.
"""

from __future__ import annotations

import contextlib
import types

import torch

HOST_DEVICE = torch.device("cpu")


class _HostStream(torch.cpu.Stream):
    """``torch.cpu.Stream`` plus the ``synchronize``/``query`` methods CUDA streams have.

    Host work is synchronous, so a stream is always idle.
    """

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostEvent(torch.cpu.Event):
    """``torch.cpu.Event`` that accepts CUDA-only constructor flags (``enable_timing`` ...)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def elapsed_time(self, end_event) -> float:
        return 0.0


def _host_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def _set_host_rng_state(new_state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(new_state)


def _no_op(*args, **kwargs):
    return None


def _zero(*args, **kwargs) -> int:
    return 0


_nvtx = types.SimpleNamespace(
    range_push=_no_op, range_pop=_no_op, mark=_no_op, range=lambda *a, **k: contextlib.nullcontext()
)

_random = types.SimpleNamespace(
    get_rng_state=_host_rng_state,
    set_rng_state=_set_host_rng_state,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
)


class _HostCuda(types.ModuleType):
    """The ``torch.cuda`` that Megatron-Core sees on the CPU platform."""

    def __init__(self):
        super().__init__("torch.cuda")
        # Device and streams: there is one host "device"; work on it is synchronous.
        self.current_device = lambda: HOST_DEVICE
        self.set_device = _no_op
        self.device_count = lambda: 1
        self.synchronize = _no_op
        self.Stream = _HostStream
        self.Event = _HostEvent
        self.current_stream = lambda device=None: _HostStream()
        self.default_stream = lambda device=None: _HostStream()
        self.stream = torch.cpu.stream
        self.set_stream = _no_op
        # RNG: on the host one generator plays the role of both the CPU and the CUDA generator.
        self.get_rng_state = _host_rng_state
        self.set_rng_state = _set_host_rng_state
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.default_generators = (torch.default_generator,)
        self.random = _random
        # Memory statistics: the host has no device allocator to report on.
        for name in (
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
        ):
            setattr(self, name, _zero)
        self.reset_peak_memory_stats = _no_op
        self.reset_max_memory_allocated = _no_op
        self.empty_cache = _no_op
        self.nvtx = _nvtx

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


HOST_CUDA = _HostCuda()
