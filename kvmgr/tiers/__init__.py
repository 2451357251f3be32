"""Tiers below the CPU tier: a local disk tier and a tier shared by many instances (Valkey/Redis).

Offers:
    TierBackend, PutResult, TierStatistics   the backend protocol and its records (base.py)
    TierNamespace                            model + layout + tenant -> stored keys (namespace.py)
    DiskTier                                 preallocated file of fixed-size slots (disk.py)
    SharedTier                               Valkey/Redis over redis.asyncio (shared.py)
    TierBridge, BridgeStatistics             CPU-tier pages <-> a backend (bridge.py)

``SharedTier`` needs the ``tiers`` extra (``redis`` for cluster hash slots); it is imported
lazily so the rest of kvmgr works without it. See docs/tiers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmgr.tiers.base import PutResult, TierBackend, TierStatistics
from kvmgr.tiers.bridge import BridgeStatistics, TierBridge
from kvmgr.tiers.disk import DiskTier
from kvmgr.tiers.namespace import TierNamespace

if TYPE_CHECKING:
    from kvmgr.tiers.shared import SharedTier

__all__ = [
    "BridgeStatistics",
    "DiskTier",
    "PutResult",
    "SharedTier",
    "TierBackend",
    "TierBridge",
    "TierNamespace",
    "TierStatistics",
]


def __getattr__(name: str) -> Any:
    if name == "SharedTier":
        try:
            from kvmgr.tiers.shared import SharedTier
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"SharedTier needs the 'tiers' extra (pip install 'kvmgr[tiers]'): {exc}"
            ) from exc
        return SharedTier
    raise AttributeError(f"module 'kvmgr.tiers' has no attribute {name!r}")
