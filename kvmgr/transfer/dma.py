"""The DMA issuer: a plan's descriptors as ``cuMemcpyBatchAsync`` calls (or a per-copy loop).

Offers:
    DmaCopy     ``issue(plan, stream)``: one driver call per chunk of at most ``max_descriptors``

The plan's own int64 arrays are the descriptor buffers: the driver reads them through their
addresses (``CopyDriver.batch_at``), nothing is copied or converted per descriptor, and the plan
stays referenced until the batch's end event (rule 7; ``CopyStreams`` holds it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
        srcs, dsts, sizes = (
            np.ascontiguousarray(a, dtype=np.int64)
            for a in (plan.src_addrs, plan.dst_addrs, plan.sizes)
        )
        keep = (srcs, dsts, sizes)
        n = len(sizes)
        handle = stream.cuda_stream
        path = batch_or_loop(self.path, self.driver.batch_abi, handle)
        if n == 0:
            return Issued(path, num_chunks=0, keep_alive=keep)
        order = self._orders[plan.direction]
        cap = self.max_descriptors
        num_chunks = 0
        try:
            if path == "batch" and self.batch_call == "ctypes":
                dst_at, src_at, size_at = dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data
                for first in range(0, n, cap):
                    offset = first * _WORD
                    self.driver.batch_at(dst_at + offset, src_at + offset, size_at + offset,
                                         min(cap, n - first), handle, order)  # fmt: skip
                    num_chunks += 1
            else:
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
            return Issued(path, num_chunks, self._fallbacks(path, num_chunks), keep, error=failure)
        return Issued(path, num_chunks, self._fallbacks(path, num_chunks), keep)

    def _fallbacks(self, path: str, num_chunks: int) -> int:
        return num_chunks if path != self.path else 0
