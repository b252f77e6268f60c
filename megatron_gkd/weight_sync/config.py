"""Weight-sync configuration."""

from __future__ import annotations

import dataclasses
import logging

from megatron_gkd.weight_sync.checksums import CHECKSUMS
from megatron_gkd.weight_sync.transports import TRANSPORTS

logger = logging.getLogger(__name__)


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
    """Per-part checksum: ``sum`` (cheap: truncated, shifted or garbage buffers), ``crc32`` (also
    reordering), ``blake3`` (cryptographic; keyed with the transport's secret it authenticates each
    part, its version and sender) or ``none`` (see :mod:`megatron_gkd.weight_sync.checksums`)."""
    verify: bool = False
    """After every sync, compare vLLM's prompt log-probs on ``verify_prompts`` with the student's."""
    verify_prompts: tuple[tuple[int, ...], ...] = ((1, 5, 9, 14, 3, 7, 2, 11),)
    verify_tolerance: float = 1e-4
    check_interval: int = 10
    """The cheap check, on by default (:mod:`megatron_gkd.trainer.engine_check`): the rollout engine's log-probs of the
    tokens it sampled against the trainer's, on the first batch a process trains and every ``check_interval``-th
    (and on every batch where the loss's own pass yields them: top-k signal at temperature 1); 0: only where free."""
    check_tolerance: float | None = None
    """The largest mean ``|log pi_train - log pi_engine|`` in nats over the tokens sampled with the weights being
    trained; past it the run stops (``StaleRolloutEngine``). Null: 1e-3 for a float32 student, 0.05 for bf16/fp16."""

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise TRANSPORTS.unknown(self.transport)
        if self.bucket_size_mb <= 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be positive, got {self.bucket_size_mb}")
        if self.num_buffers < 1:
            raise ValueError(f"weight_sync.num_buffers must be >= 1, got {self.num_buffers}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"weight_sync.transfer={self.transfer!r}; choose one of {list(TRANSFERS)}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"weight_sync.checksum={self.checksum!r}; choose one of {sorted(CHECKSUMS)}")
        if self.check_interval < 0:
            raise ValueError(f"weight_sync.check_interval must be >= 0 (0: only where free), got {self.check_interval}")
        if self.check_tolerance is not None and not self.check_tolerance > 0:
            raise ValueError(f"weight_sync.check_tolerance must be > 0 nats, got {self.check_tolerance}")
        if self.verify and not self.verify_prompts:
            raise ValueError("weight_sync.verify=True needs verify_prompts (token id lists)")

    def resolved_transfer(self, transport) -> str:
        """``packed`` or ``direct`` for ``transport``."""
        if self.transfer != "auto":
            return self.transfer
        return "direct" if getattr(transport, "backend", None) == "gloo" else "packed"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)


def warn_if_unauthenticated(config: WeightSyncConfig, key: bytes | None) -> None:
    """With the run's secret, only ``blake3`` authenticates what arrives; say so once per process."""
    global _warned
    if key is not None and config.checksum != "blake3" and not _warned:
        _warned = True
        logger.warning("weight_sync.checksum=%r does not authenticate buckets although the transport has a "
                       "secret: a forger on the network could alter weights unnoticed; use checksum='blake3'",
                       config.checksum)


_warned = False
