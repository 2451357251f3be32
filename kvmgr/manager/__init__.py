"""The manager: an asyncio facade over a bookkeeper, a swap queue and a transfer engine.

Offers:
    OffloadManager    the facade (facade.py); everything a serving loop calls
    ManagerSnapshot   what ``OffloadManager.snapshot()`` returns (snapshot.py)
    CpuState, GpuState   the named states of CPU and GPU blocks

Modules: ``bookkeeping`` (the Bookkeeper: prepare_* -> Part, complete; no asyncio, no engine),
``cpu_tier`` (CPU blocks, keys, eviction), ``gpu_pool`` (GPU blocks, the owned pool),
``requests`` (block tables, preempt/resume), ``queue`` (generations, lanes, batches),
``flush`` (plans, submission, completion), ``backpressure``, ``events`` (the KV event stream),
``counters``, ``snapshot``.
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
