"""Why a weight sync did not complete. Every one leaves the receiving engines stale (they refuse to
generate) until a sync succeeds; callers catch :class:`WeightSyncError` and may retry."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync did not complete on every rank."""


class WeightSyncTransportError(WeightSyncError):
    """The transport failed (a timeout, a closed connection, a peer that died): its groups are unusable;
    build a new transport before syncing again."""


class ChecksumMismatch(WeightSyncError):
    """A received bucket does not carry the bytes that were sent (or not the version expected)."""
