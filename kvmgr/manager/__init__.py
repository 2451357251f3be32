"""The manager: an asyncio facade over a bookkeeper, a swap queue and a transfer engine.

Offers:
    OffloadManager    the facade (facade.py); everything a serving loop calls
    ManagerSnapshot   what ``OffloadManager.snapshot()`` returns (snapshot.py)
    CpuState, GpuState   the named states of CPU and GPU blocks

Modules: ``facade`` (``OffloadManager``, joining the call groups ``keyed``, ``request_calls``,
``staged_calls`` and ``observe`` over ``core``), ``build`` (makes and connects the parts),
``flush`` (plans, submission, completion), ``backpressure`` (stores waiting for room),
``layerwise``, ``lower_tiers``, ``snapshot``. The bookkeeping itself (CPU tier, GPU blocks,
block tables, queue, KV events, counters) is ``kvmgr.scheduler``.
"""

from __future__ import annotations

from kvmgr.manager.facade import OffloadManager
from kvmgr.manager.snapshot import (
    BatchSnapshot,
    KeySnapshot,
    ManagerSnapshot,
    SwapSnapshot,
    TableSnapshot,
)
from kvmgr.scheduler.cpu_tier import CpuState
from kvmgr.scheduler.gpu_blocks import GpuState

__all__ = [
    "BatchSnapshot",
    "CpuState",
    "GpuState",
    "KeySnapshot",
    "ManagerSnapshot",
    "OffloadManager",
    "SwapSnapshot",
    "TableSnapshot",
]
