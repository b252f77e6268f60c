"""Weight-sync configuration."""

from __future__ import annotations

import dataclasses

from megatron_gkd.weight_sync.buckets import CHECKSUMS


TRANSFERS = ("auto", "packed", "direct")


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """How the trainer's weights reach the rollout engine."""

    transport: str = "distributed"
    """``distributed`` (a dedicated process group to rollout ranks) or ``colocated`` (same process)."""
    bucket_size_mb: float = 512.0
    """Payload per bucket; a larger tensor travels alone."""
    num_buffers: int = 2
    """Bucket buffers per side; 2 overlaps gathering/packing bucket i+1 with sending bucket i."""
    transfer: str = "auto"
    """Distributed transport: ``packed`` (each sender copies its slices into a bucket buffer, one
    broadcast per part; the receiver copies the tensors out of a reused buffer: little memory, few
    operations), ``direct`` (no copies: each slice is broadcast from the parameter into its place in a
    receive arena as large as the model, kept between syncs; tensors reach vLLM as views of it) or
    ``auto`` (``direct`` over host memory (gloo), where copies cost more than operations, else
    ``packed``)."""
    checksum: str = "sum"
    """Per-bucket checksum: ``sum`` (cheap), ``crc32`` (order-sensitive, slower) or ``none``."""
    verify: bool = False
    """After every sync, compare vLLM's prompt log-probs on ``verify_prompts`` with the student's."""
    verify_prompts: tuple[tuple[int, ...], ...] = ((1, 5, 9, 14, 3, 7, 2, 11),)
    verify_tolerance: float = 1e-4

    def __post_init__(self):
        from megatron_gkd.weight_sync.transports import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport={self.transport!r}; choose one of {sorted(TRANSPORTS)}")
        if self.bucket_size_mb <= 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be positive, got {self.bucket_size_mb}")
        if self.num_buffers < 1:
            raise ValueError(f"weight_sync.num_buffers must be >= 1, got {self.num_buffers}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"weight_sync.transfer={self.transfer!r}; choose one of {list(TRANSFERS)}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"weight_sync.checksum={self.checksum!r}; choose one of {sorted(CHECKSUMS)}")
        if self.verify and not self.verify_prompts:
            raise ValueError("weight_sync.verify=True needs verify_prompts (token id lists)")

    def resolved_transfer(self, transport) -> str:
        """``packed`` or ``direct`` for ``transport`` (a colocated transport always packs)."""
        if not getattr(transport, "needs_buffers", True):
            return "packed"
        if self.transfer != "auto":
            return self.transfer
        return "direct" if getattr(transport, "backend", None) == "gloo" else "packed"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)
