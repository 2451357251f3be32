"""Typed counters of the manager: plain integer fields, incremented in place on the hot path.

Private to ``kvmgr.scheduler``: ``OffloadManager.statistics()`` turns them into the frozen
``ManagerStatistics`` value.
"""

from __future__ import annotations

import bisect

from kvmgr.reports import Histogram

__all__ = ["Counters", "HistogramCounter"]


class HistogramCounter:
    """Counts observations in fixed buckets (see ``kvmgr.reports.Histogram``)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def freeze(self) -> Histogram:
        """The current counts as a frozen value."""
        return Histogram(self.bounds, tuple(self.counts), self.total)


#: Buckets of blocks per batch and of completion seconds (1 us .. 10 s).
BATCH_BLOCK_BOUNDS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0)
COMPLETION_S_BOUNDS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0, 10.0)


class Counters:
    """Every counter of ``ManagerStatistics``; each field is documented there."""

    #: the plain totals, copied by name into ``ManagerStatistics``
    TOTALS = (
        "lookups",
        "lookup_keys",
        "lookup_hits",
        "peeks",
        "stores_queued",
        "stores_completed",
        "stores_failed",
        "stores_skipped",
        "stores_not_admitted",
        "loads_queued",
        "loads_completed",
        "loads_failed",
        "evictions",
        "invalidated",
        "await_timeouts",
        "bytes_d2h",
        "bytes_h2d",
        "device_s_d2h",
        "device_s_h2d",
        "steps",
    )

    __slots__ = (
        "await_timeouts",
        "batch_blocks",
        "bytes_d2h",
        "bytes_h2d",
        "completion_s",
        "device_s_d2h",
        "device_s_h2d",
        "evictions",
        "invalidated",
        "loads_completed",
        "loads_failed",
        "loads_queued",
        "lookup_hits",
        "lookup_keys",
        "lookups",
        "peeks",
        "rejected",
        "steps",
        "stores_completed",
        "stores_failed",
        "stores_not_admitted",
        "stores_queued",
        "stores_skipped",
    )

    def __init__(self) -> None:
        self.lookups = self.lookup_keys = self.lookup_hits = self.peeks = 0
        self.stores_queued = self.stores_completed = self.stores_failed = 0
        self.stores_skipped = self.stores_not_admitted = 0
        self.loads_queued = self.loads_completed = self.loads_failed = 0
        self.evictions = self.invalidated = self.await_timeouts = self.steps = 0
        self.bytes_d2h = self.bytes_h2d = 0
        self.device_s_d2h = self.device_s_h2d = 0.0
        #: calls refused, by reason ("cpu_full", "gpu_full", "timeout")
        self.rejected: dict[str, int] = {}
        self.batch_blocks = HistogramCounter(BATCH_BLOCK_BOUNDS)
        self.completion_s = HistogramCounter(COMPLETION_S_BOUNDS)

    def reject(self, reason: str) -> None:
        """Count one refused call."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
