"""What a ``TierBridge`` reports and hands back (re-exported by ``kvmgr.tiers.bridge``).

Offers:
    BridgeStatistics   frozen counters of one bridge (totals)
    BridgeCounters     their mutable twin, updated by the bridge
    StagedBlobs        blobs gathered by ``TierBridge.stage``, not written yet
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["BridgeCounters", "BridgeStatistics", "StagedBlobs"]


@attrs.define
class _BridgeTotals:
    """The counter fields of one bridge, declared once (``BridgeStatistics`` documents them)."""

    num_demoted: int = 0
    num_demote_failed: int = 0
    num_promoted: int = 0
    num_promote_misses: int = 0
    num_layout_mismatch: int = 0
    num_corrupt: int = 0
    num_errors: int = 0
    bytes_demoted: int = 0
    bytes_promoted: int = 0


@attrs.frozen
class BridgeStatistics(_BridgeTotals):
    """Totals since construction.

    Attributes:
        num_demoted: blocks written to the backend.
        num_demote_failed: blocks a failed ``put_many`` did not store.
        num_promoted: blocks read, verified and scattered into CPU blocks.
        num_promote_misses: blocks asked for and not promoted (miss, corrupt, error).
        num_layout_mismatch: blobs of another layout (another fingerprint; never served).
        num_corrupt: blobs rejected by verification: damaged, truncated, moved under another
            key, or (sealed namespaces) without the tenant's valid MAC. Never served.
        num_errors: tier errors turned into ``False`` results.
        bytes_demoted / bytes_promoted: payload bytes moved.
    """


@attrs.frozen(eq=False)
class StagedBlobs:
    """Blobs gathered by ``TierBridge.stage``, not written yet.

    Attributes:
        stored_keys: the namespaced keys, one per blob.
        buffer: the staging array (reused after a successful write).
        padded: ``buffer``'s first rows, each a blob padded to the backend's row size.
        rows: the same rows cut to ``blob_bytes``.
    """

    stored_keys: list[bytes]
    buffer: np.ndarray
    padded: np.ndarray
    rows: np.ndarray


@attrs.define
class BridgeCounters(_BridgeTotals):
    """The running totals of one bridge (frozen by ``statistics()``)."""
