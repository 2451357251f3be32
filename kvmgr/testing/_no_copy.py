"""What a ``ScriptedEngine`` without an inner engine reports: it copies nothing, so it makes up
each batch's result and keeps its own totals.

Private to ``kvmgr.testing``.
"""

from __future__ import annotations

import concurrent.futures

from kvmgr.transfer.engine import BatchHandle, BatchResult, BatchTotals
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["completed_handle", "count_batch", "no_copy_result"]


def count_batch(totals: BatchTotals, plan: TransferPlan, *, ok: bool) -> None:
    """Count one ended batch of ``plan`` in ``totals`` (failed, or completed with its bytes)."""
    if not ok:
        totals.batches_failed += 1
        return
    totals.batches_completed += 1
    if plan.direction is Direction.D2H:
        totals.bytes_d2h += plan.num_bytes
    else:
        totals.bytes_h2d += plan.num_bytes


def no_copy_result(batch_id: int, plan: TransferPlan, path: str) -> BatchResult:
    """The result of a batch that copied nothing: ``plan``'s bytes, no descriptors, no time."""
    return BatchResult(
        batch_id=batch_id,
        direction=plan.direction,
        num_bytes=plan.num_bytes,
        num_descriptors=0,
        device_s=None,
        path=path,
    )


def completed_handle(
    totals: BatchTotals, batch_id: int, plan: TransferPlan, path: str
) -> BatchHandle:
    """The handle of a batch that copied nothing and is done already (counted in ``totals``:
    ``count_batch`` and ``no_copy_result`` in one frame, the host benchmarks' every batch)."""
    direction, num_bytes = plan.direction, plan.num_bytes
    totals.batches_completed += 1
    if direction is Direction.D2H:
        totals.bytes_d2h += num_bytes
    else:
        totals.bytes_h2d += num_bytes
    future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
    result = BatchResult(batch_id=batch_id, direction=direction, num_bytes=num_bytes,
                         num_descriptors=0, device_s=None, path=path)  # fmt: skip
    future.set_result(result)
    return BatchHandle(batch_id, direction, future)
