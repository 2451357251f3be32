"""Value objects the manager returns: per swap, per step, and running totals.

Offers:
    SwapResult          what one completed swap moved
    DirectionReport     one direction's batch in one step
    StepReport          what one ``step()`` did
    ManagerStatistics   totals since the manager was created (counters only grow)
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvmgr.hooks import HookReport
from kvmgr.transfer.engine import BatchResult

__all__ = ["DirectionReport", "ManagerStatistics", "StepReport", "SwapResult"]


@attrs.frozen(kw_only=True)
class SwapResult:
    """One completed swap.

    Attributes:
        num_blocks: blocks copied.
        num_bytes: bytes copied (blocks x bytes per block).
        num_skipped: keys of a store that were already in the CPU tier and were not copied.
        block_ids: destination block ids, in the order of the call (CPU ids for stores and
            preempts, GPU ids for loads and resumes); for a preempt, the GPU ids it freed.
    """

    num_blocks: int
    num_bytes: int
    num_skipped: int = 0
    block_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class DirectionReport:
    """What one step submitted in one direction.

    Attributes:
        swaps: swap calls flushed.
        blocks: blocks to copy.
        pages: pages (blocks x tensors): descriptors before merging.
        descriptors: descriptors after merging.
        bytes: bytes to copy.
        batches: plans submitted (1, or more when a hazard forced ordered batches).
    """

    swaps: int = 0
    blocks: int = 0
    pages: int = 0
    descriptors: int = 0
    bytes: int = 0
    batches: int = 0


@attrs.frozen(kw_only=True)
class StepReport:
    """What one ``OffloadManager.step()`` did.

    Attributes:
        step: step number.
        d2h: stores and preempts submitted (GPU -> CPU).
        h2d: loads and resumes submitted (CPU -> GPU).
        hooks: one report per hook, in run order.
        completed: batches that completed since the previous step, with bytes and device seconds.
        host_s: host seconds spent inside ``step()`` (hooks, planning, submission).
    """

    step: int
    d2h: DirectionReport
    h2d: DirectionReport
    hooks: tuple[HookReport, ...] = ()
    completed: tuple[BatchResult, ...] = ()
    host_s: float = 0.0


@attrs.frozen(kw_only=True)
class ManagerStatistics:
    """Totals since the manager was created (every counter only grows), plus current occupancy.

    Attributes:
        lookups: ``lookup`` calls. lookup_keys / lookup_hits: keys asked / READY prefix hits.
        stores_queued / stores_completed / stores_failed: blocks stored (swap_out + preempt).
        stores_skipped: store keys already present, not copied.
        loads_queued / loads_completed / loads_failed: blocks loaded (swap_in + resume).
        evictions: CPU blocks evicted by the policy.
        rejected: stores rejected, by reason (``"cpu_full"``, ``"timeout"``, ...).
        bytes_d2h / bytes_h2d: bytes of completed batches. device_s_d2h / device_s_h2d: their
            device seconds.
        batches_in_flight: batches submitted and not completed. queued_swaps: swaps not flushed.
        cpu_blocks_used / cpu_blocks_total: CPU tier occupancy (keyed + request blocks).
        cpu_keys_pending / cpu_keys_ready: keyed blocks by state.
        gpu_blocks_free: free GPU blocks of the owned pool (``None`` when not owned).
        steps: ``step()`` calls.
        policy: eviction policy name. engine: engine name.
    """

    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    stores_queued: int = 0
    stores_completed: int = 0
    stores_failed: int = 0
    stores_skipped: int = 0
    loads_queued: int = 0
    loads_completed: int = 0
    loads_failed: int = 0
    evictions: int = 0
    rejected: Mapping[str, int] = attrs.field(factory=dict)
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    device_s_d2h: float = 0.0
    device_s_h2d: float = 0.0
    batches_in_flight: int = 0
    queued_swaps: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_total: int = 0
    cpu_keys_pending: int = 0
    cpu_keys_ready: int = 0
    gpu_blocks_free: int | None = None
    steps: int = 0
    policy: str = ""
    engine: str = ""
