"""The DMA issuer: a plan's descriptors as ``cuMemcpyBatchAsync`` calls (or a per-copy loop).

Offers:
    DmaCopy             ``issue(plan, stream)``: one driver call per chunk of at most
                        ``max_descriptors``
    DescriptorBuffers   reusable int64 host buffers for descriptor tables (addresses known)

The driver reads one int64 ``[3, n]`` descriptor table (sources, destinations, bytes) through the
addresses of its rows (``CopyDriver.batch_at``); nothing is converted per descriptor. For a plan
from ``build_plan`` the table is computed straight into a pooled buffer whose address is known
(``BlockPairs.descriptor_table(out=...)``: a few numpy operations; the plan's own descriptor
arrays are never built), and the buffer goes back to the pool after the batch's end event
(``Issued.release``, rule 7). Any other plan's arrays are copied into one new table, kept alive
until that event.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmgr._size_pool import SizePool
from kvmgr.errors import TransferError
from kvmgr.transfer.driver import CopyDriver, access_order, batch_or_loop
from kvmgr.transfer.issued import Issued
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["DescriptorBuffers", "DmaCopy"]

_WORD = 8  # bytes per descriptor entry (int64 / size_t / CUdeviceptr)
_MIN_DESCRIPTORS = 256  # smallest buffer: 6 KiB
_MAX_STREAMS = 64  # stream handles whose path is remembered


class _Buffer:
    __slots__ = ("_count", "_table", "address", "capacity", "rows")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows = np.empty(3 * capacity, dtype=np.int64)
        self.address = int(self.rows.ctypes.data)
        self._count, self._table = 0, self.rows[:0].reshape(3, 0)

    def table(self, n: int) -> np.ndarray:
        """The buffer's first ``3 * n`` entries as a C-contiguous int64 ``[3, n]`` view, kept
        for the last ``n`` asked for (a steady loop's steps reuse it: two numpy calls fewer a
        step). Used by one batch at a time (taken, then given back after its end event)."""
        if n != self._count:
            self._count, self._table = n, self.rows[: 3 * n].reshape(3, n)
        return self._table


class DescriptorBuffers(SizePool[_Buffer]):
    """Free ``3 * capacity`` int64 host buffers by size class (powers of two from 256
    descriptors); ``take`` on the submitting thread, ``give`` from the completion thread."""

    def __init__(self) -> None:
        super().__init__(_Buffer, _MIN_DESCRIPTORS)


class DmaCopy:
    """Issues plans with the driver's batched copy.

    Args:
        driver: resolved entry points.
        path: ``"batch"`` or ``"loop"`` (``"batch"`` still falls back to the loop on the legacy
            default stream, rule 1); fixed at construction (the choice is remembered per stream).
        max_descriptors: descriptors per driver call; larger plans are issued in chunks.
        batch_call: ``"ctypes"`` (raw addresses, the default) or ``"lists"`` (cuda-python lists).

    Attributes:
        buffers: the pool of descriptor tables for plans from ``build_plan``.
    """

    def __init__(
        self, driver: CopyDriver, path: str, max_descriptors: int, batch_call: str = "ctypes"
    ) -> None:
        self.driver = driver
        self.path = path
        self.max_descriptors = max_descriptors
        self.batch_call = batch_call
        self.buffers = DescriptorBuffers()
        self._orders = {d: access_order(d) for d in Direction}
        self._paths: dict[int, str] = {}  # stream handle -> batch_or_loop (fixed for a handle)

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Enqueue the plan's copies on ``stream``; a refused call is returned in ``error`` with
        ``fail_index`` in plan coordinates (chunks before it still run)."""
        handle = stream.cuda_stream
        path = self._paths.get(handle)
        if path is None:  # per stream handle: the requested path, the ABI and the handle decide
            path = batch_or_loop(self.path, self.driver.batch_abi, handle)
            if len(self._paths) < _MAX_STREAMS:
                self._paths[handle] = path
        pairs = plan.matching_blocks()
        n = plan.num_descriptors if pairs is None else pairs.num_descriptors
        if n == 0:
            return Issued(path, num_chunks=0)
        if pairs is not None:  # computed into a pooled buffer: no allocation, address known
            buffer = self.buffers.take(n)
            table = pairs.descriptor_table(buffer._table if buffer._count == n else buffer.table(n))
            address, keep = buffer.address, ()
            release = lambda: self.buffers.give(buffer)  # noqa: E731  (after the end event)
            if path == "batch" and n <= self.max_descriptors and self.batch_call == "ctypes":
                try:  # the common plan: one batched call, what _copy does for it without the loop
                    self.driver.batch_at(address + n * _WORD, address, address + 2 * n * _WORD, n,
                                         handle, self._orders[plan.direction])  # fmt: skip
                except TransferError as exc:
                    error = TransferError(str(exc), fail_index=exc.fail_index)
                    return Issued(path, 0, 0, (), release, error)
                return Issued(path, 1, 0, (), release)
        else:
            table = plan.descriptor_table()
            address, keep, release = None, (table,), None
        order = self._orders[plan.direction]
        num_chunks, error = self._copy(path, table, address, handle, order)
        fallbacks = num_chunks if path != self.path else 0
        return Issued(path, num_chunks, fallbacks, keep, release, error)

    def _copy(
        self, path: str, table: np.ndarray, address: int | None, handle: int, order: int
    ) -> tuple[int, TransferError | None]:
        """The driver calls of one ``[3, n]`` table, ``max_descriptors`` at a time: their
        count, and the refusal that stopped them (``fail_index`` in table coordinates) or
        ``None``."""
        n, cap, driver = table.shape[1], self.max_descriptors, self.driver
        num_chunks = 0
        try:
            if path == "batch" and self.batch_call == "ctypes":
                src_at = int(table.ctypes.data) if address is None else address
                dst_at, size_at = src_at + n * _WORD, src_at + 2 * n * _WORD
                for first in range(0, n, cap):
                    offset = first * _WORD
                    driver.batch_at(dst_at + offset, src_at + offset, size_at + offset,
                                    min(cap, n - first), handle, order)  # fmt: skip
                    num_chunks += 1
            else:
                srcs, dsts, sizes = table
                for first in range(0, n, cap):
                    part = slice(first, first + cap)
                    if path == "batch":
                        driver.batch_lists(dsts[part], srcs[part], sizes[part], handle, order)
                    else:
                        driver.loop(dsts[part], srcs[part], sizes[part], handle)
                    num_chunks += 1
        except TransferError as exc:
            index = None if exc.fail_index is None else num_chunks * cap + exc.fail_index
            return num_chunks, TransferError(str(exc), fail_index=index)
        return num_chunks, None
