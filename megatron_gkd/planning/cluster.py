"""Devices and clusters the planner fits layouts onto."""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator: its memory and what the runtime takes before any tensor is allocated."""

    name: str
    memory_gib: float
    """Memory the framework reports as the device's total (the total of the runtime's ``mem_get_info``)."""
    reserved_gib: float = 3.0
    """Taken outside the tensor allocator: the CUDA / CANN context, NCCL / HCCL buffers, and the
    allocator's fragmentation. A plan must leave it free."""
    supports_fp8: bool = True
    """FP8 matmuls (Hopper and newer). Without them an FP8 checkpoint is served in bf16 or int8."""

    def __post_init__(self):
        if self.memory_gib <= 0 or not 0 <= self.reserved_gib < self.memory_gib:
            raise ValueError(f"device {self.name}: need memory_gib > reserved_gib >= 0")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def usable_bytes(self) -> int:
        """What tensors may hold: total minus the runtime's reserve."""
        return int((self.memory_gib - self.reserved_gib) * GIB)


# Totals as the runtimes report them (an "80 GB" H100 shows 79.1 GiB); override with memory_gib.
DEVICES = {
    "h100-80gb": Device(name="h100-80gb", memory_gib=79.1),
    "a100-80gb": Device(name="a100-80gb", memory_gib=79.1, supports_fp8=False),
    "h200-141gb": Device(name="h200-141gb", memory_gib=139.8),
    # Ascend 910B: 64 GB HBM; CANN and HCCL keep more for themselves than CUDA does.
    "ascend-910b-64gb": Device(name="ascend-910b-64gb", memory_gib=64.0, reserved_gib=4.0, supports_fp8=False),
    # Ascend 910C (Atlas A3): two dies per package with 128 GB HBM between them; each die is its own
    # torch_npu device with half of it, so plans count per die (16 devices per 8-package node).
    "ascend-910c-die-64gb": Device(name="ascend-910c-die-64gb", memory_gib=64.0, reserved_gib=4.0,
                                   supports_fp8=False),
}


def get_device(name: str) -> Device:
    """A preset from :data:`DEVICES`.

    Raises:
        ValueError: unknown name; the message lists the presets.
    """
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(DEVICES)} (or give memory_gib)")
    return DEVICES[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices."""

    nodes: int
    devices_per_node: int
    device: Device

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError("cluster.nodes and cluster.devices_per_node must be positive")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        return f"{self.nodes} x {self.devices_per_node} x {self.device.name} ({self.device.memory_gib:g} GiB)"
