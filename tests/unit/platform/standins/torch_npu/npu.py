"""``torch.npu`` of the stand-in: the device API the platform layer calls, answered by the host and recorded.

Real torch_npu registers its ``torch_npu.npu`` module as ``torch.npu`` (``torch._register_device_module``).
The stand-in NPU is the host: one generator state per process stands in for the device generator, memory
statistics are zero, work is synchronous.
"""

from __future__ import annotations

import os

import torch

from torch_npu._standin import record

_device_index = 0
_generator = torch.Generator()


def is_available() -> bool:
    record("is_available")
    return True


def device_count() -> int:
    record("device_count")
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def current_device() -> int:
    record("current_device", index=_device_index)
    return _device_index


def set_device(device) -> None:
    global _device_index
    index = device if isinstance(device, int) else torch.device(device).index or 0
    record("set_device", index=index)
    _device_index = index


def synchronize(device=None) -> None:
    record("synchronize")


def manual_seed(seed: int) -> None:
    record("manual_seed", seed=seed)
    _generator.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    record("manual_seed_all", seed=seed)
    _generator.manual_seed(seed)


def get_rng_state(device="npu") -> torch.Tensor:
    record("get_rng_state")
    return _generator.get_state()


def set_rng_state(new_state: torch.Tensor, device="npu") -> None:
    record("set_rng_state")
    _generator.set_state(new_state)


def empty_cache() -> None:
    record("empty_cache")


def max_memory_allocated(device=None) -> int:
    record("max_memory_allocated")
    return 0


def memory_allocated(device=None) -> int:
    record("memory_allocated")
    return 0
