"""A stand-in for ``torch_npu`` (tests only: put ``tests/unit/platform/standins`` on ``PYTHONPATH``).

It makes the registrations real torch_npu makes when imported (``torch_npu/__init__.py``):

* torch's PrivateUse1 backend is renamed ``npu`` (``torch.utils.rename_privateuse1_backend``), so
  ``torch.device("npu", 0)`` is a device, and ``torch.npu`` is registered (``torch._register_device_module``);
* ``hccl`` is registered with ``torch.distributed`` (``Backend.register_backend``),
  ``torch.distributed.is_hccl_available()`` is true, and ``torch.distributed.ProcessGroupHCCL(store, rank,
  size, timeout)`` (its documented signature) builds a group.

What differs is the hardware: the stand-in NPU is the host. An HCCL group is a gloo group, and a tensor
placed on an ``npu`` device lands in host memory: the torch functions that take a device are wrapped to
map it, in the way real ``torch_npu.contrib.transfer_to_npu`` wraps them to map ``cuda`` to ``npu``. Pinned
host memory (staging for copies to and from the NPU) is plain host memory here: real torch_npu provides it
through hooks registered in C++, which a stand-in cannot register. Every request (device API, HCCL group,
placement, pinning) is recorded with the stack that made it (:mod:`._standin`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from torch_npu import npu
from torch_npu._standin import record

DEVICE_TYPE = "npu"
HOST = torch.device("cpu")


def _is_npu(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == DEVICE_TYPE
    return isinstance(device, str) and device.split(":")[0] == DEVICE_TYPE


def _to_host(device, via: str):
    if _is_npu(device):
        record("place", via=via, device=str(device))
        return HOST
    return device


def _factory(name: str):
    original = getattr(torch, name)

    @functools.wraps(original)
    def placed(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_host(kwargs["device"], name)
        if kwargs.pop("pin_memory", False):
            record("pin_memory", via=name)
        return original(*args, **kwargs)

    return placed


_FACTORIES = ("arange", "as_tensor", "empty", "empty_like", "empty_strided", "eye", "full", "full_like", "linspace",
              "ones", "ones_like", "rand", "rand_like", "randint", "randn", "randn_like", "randperm", "tensor", "zeros",
              "zeros_like")
_TENSOR_FACTORIES = ("new_empty", "new_full", "new_ones", "new_tensor", "new_zeros")


def _tensor_method(name: str):
    original = getattr(torch.Tensor, name)

    @functools.wraps(original)
    def placed(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_host(kwargs["device"], f"Tensor.{name}")
        return original(self, *args, **kwargs)

    return placed


_tensor_to = torch.Tensor.to


@functools.wraps(_tensor_to)
def _to(self, *args, **kwargs):
    if args and (isinstance(args[0], (torch.device, str))):
        args = (_to_host(args[0], "Tensor.to"), *args[1:])
    if "device" in kwargs:
        kwargs["device"] = _to_host(kwargs["device"], "Tensor.to")
    return _tensor_to(self, *args, **kwargs)


def _pin_memory(self, *args, **kwargs):
    record("pin_memory", via="Tensor.pin_memory")
    return self


def _hccl_group(store, rank: int, size: int, timeout):
    record("hccl_group", rank=rank, size=size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _register() -> None:
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch._register_device_module(DEVICE_TYPE, npu)
    for name in _FACTORIES:
        setattr(torch, name, _factory(name))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _tensor_method(name))
    torch.Tensor.to = _to
    torch.Tensor.pin_memory = _pin_memory
    # The stand-in's "NPU" memory is host memory, so its HCCL groups serve host tensors.
    dist.Backend.register_backend("hccl", _hccl_group, devices=["cpu"])
    dist.is_hccl_available = lambda: True
    dist.ProcessGroupHCCL = _hccl_group
    record("import_torch_npu")


_register()
