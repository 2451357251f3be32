"""The scheduler side of kvmgr: no tensors, no torch, no CUDA.

Offers:
    Scheduler     bookkeeping + swap queue -> transfer jobs in block ids (scheduler.py)
    Settled       a job's outcome applied: the lane to resolve, its error, stores landed
    TransferJob   one batch of copies of one direction, rank-agnostic (jobs.py)
    JobOutcome    a job's end, folded over every rank
    KVGeometry    blocks, page bytes and the rank layout (``"heads"`` / ``"replicated"``)
    Direction     D2H (store) / H2D (load)
    Bookkeeper, Landed   the states of every block, key and request (bookkeeping.py)
    CpuState, GpuState   the named states of CPU and GPU blocks

Modules: ``bookkeeping``, ``store`` (keyed stores, step by step; ``key_index``: the one-pass
store of keys all new), ``keys`` (validation), ``cpu_tier`` (CPU blocks, key index, eviction),
``gpu_blocks`` (busy counts, the owned pool), ``requests`` (block tables, preempt/resume),
``queue`` (generations, lanes, batches in flight), ``events`` (the KV event stream),
``counters``, ``jobs``. ``tests/scheduler/test_scheduler_split.py`` imports this package with
torch blocked.
"""

from __future__ import annotations

from kvmgr.scheduler.bookkeeping import Bookkeeper, Landed
from kvmgr.scheduler.cpu_tier import CpuState
from kvmgr.scheduler.gpu_blocks import GpuState
from kvmgr.scheduler.jobs import Direction, JobOutcome, KVGeometry, TransferJob
from kvmgr.scheduler.scheduler import Scheduler, Settled

__all__ = [
    "Bookkeeper",
    "CpuState",
    "Direction",
    "GpuState",
    "JobOutcome",
    "KVGeometry",
    "Landed",
    "Scheduler",
    "Settled",
    "TransferJob",
]
