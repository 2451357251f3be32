"""The DMA issuer: a plan's descriptors as ``cuMemcpyBatchAsync`` calls (or a per-copy loop).

Offers:
    DmaCopy     ``issue(plan, stream)``: one driver call per chunk of at most ``max_descriptors``

The plan's descriptor table (``TransferPlan.descriptor_table``: int64 ``[3, n]``, one allocation,
built in a few numpy operations for a plan from ``build_plan``) is the descriptor buffer: the
driver reads its three rows through their addresses (``CopyDriver.batch_at``), nothing is copied
or converted per descriptor, and the table stays referenced until the batch's end event (rule 7;
``Issued.keep_alive``).
"""

from __future__ import annotations

from typing import Any

from kvmgr.errors import TransferError
from kvmgr.transfer.driver import CopyDriver, access_order, batch_or_loop
from kvmgr.transfer.plan import Direction, TransferPlan
from kvmgr.transfer.streams import Issued

__all__ = ["DmaCopy"]

_WORD = 8  # bytes per descriptor entry (int64 / size_t / CUdeviceptr)


class DmaCopy:
    """Issues plans with the driver's batched copy.

    Args:
        driver: resolved entry points.
        path: ``"batch"`` or ``"loop"`` (``"batch"`` still falls back to the loop on the legacy
            default stream, rule 1).
        max_descriptors: descriptors per driver call; larger plans are issued in chunks.
        batch_call: ``"ctypes"`` (raw addresses, the default) or ``"lists"`` (cuda-python lists).
    """

    def __init__(
        self, driver: CopyDriver, path: str, max_descriptors: int, batch_call: str = "ctypes"
    ) -> None:
        self.driver = driver
        self.path = path
        self.max_descriptors = max_descriptors
        self.batch_call = batch_call
        self._orders = {d: access_order(d) for d in Direction}

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Enqueue the plan's copies on ``stream``; a refused call is returned in ``error`` with
        ``fail_index`` in plan coordinates (chunks before it still run)."""
        table = plan.descriptor_table()  # int64 [3, n], C-contiguous: srcs, dsts, sizes
        n = table.shape[1]
        handle = stream.cuda_stream
        path = batch_or_loop(self.path, self.driver.batch_abi, handle)
        if n == 0:
            return Issued(path, num_chunks=0, keep_alive=(table,))
        order = self._orders[plan.direction]
        cap = self.max_descriptors
        num_chunks = 0
        try:
            if path == "batch" and self.batch_call == "ctypes":
                src_at = table.ctypes.data
                dst_at, size_at = src_at + n * _WORD, src_at + 2 * n * _WORD
                for first in range(0, n, cap):
                    offset = first * _WORD
                    self.driver.batch_at(dst_at + offset, src_at + offset, size_at + offset,
                                         min(cap, n - first), handle, order)  # fmt: skip
                    num_chunks += 1
            else:
                srcs, dsts, sizes = table
                for first in range(0, n, cap):
                    part = slice(first, first + cap)
                    if path == "batch":
                        self.driver.batch_lists(dsts[part], srcs[part], sizes[part], handle, order)
                    else:
                        self.driver.loop(dsts[part], srcs[part], sizes[part], handle)
                    num_chunks += 1
        except TransferError as exc:
            index = None if exc.fail_index is None else num_chunks * cap + exc.fail_index
            failure = TransferError(str(exc), fail_index=index)
            return Issued(path, num_chunks, self._fallbacks(path, num_chunks), (table,),
                          error=failure)  # fmt: skip
        return Issued(path, num_chunks, self._fallbacks(path, num_chunks), (table,))

    def _fallbacks(self, path: str, num_chunks: int) -> int:
        return num_chunks if path != self.path else 0
