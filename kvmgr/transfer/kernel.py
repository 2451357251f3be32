"""The copy-kernel issuer: a whole plan in one ``kvmgr.kernels.copy_pages`` launch.

Offers:
    KernelCopy      ``issue(plan, stream)``: table into a reusable pinned slot, one upload, one launch
    TableSlots      the pool of reusable (pinned host, device) table buffers
    new_table_slot  allocate one slot (module-level so CPU tests can stand in for CUDA memory)

Per plan: the descriptors are written into a pinned host buffer as a packed ``[3, n]`` table
(sources, destinations, bytes), copied to a device buffer with one ``cuMemcpyAsync`` on the copy
stream, and the kernel is launched on that stream with the launcher that skips Triton's per-call
dispatch. Buffers come from a pool and go back to it on the completion thread after the batch's
end event (rule 7), so a steady stream of batches allocates nothing. Descriptors above
``chunk_bytes`` (merged runs) are sliced first (``build_descriptor_table``) so one run spreads
over every program.

The kernel dereferences host addresses, so every host page must be pinned or registered.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import TransferError
from kvmgr.kernels.copy_pages import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_D2H_PROGRAMS,
    DEFAULT_H2D_PROGRAMS,
    build_descriptor_table,
    launch_copy_table,
)
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, TransferPlan
from kvmgr.transfer.streams import Issued

__all__ = ["KernelCopy", "TableSlots", "new_table_slot"]

_MIN_ITEMS = 4096  # smallest slot: 96 KiB of table each side
_WORD = 8


@attrs.define(eq=False)
class TableSlot:
    """One reusable table: ``capacity`` rows on the host (pinned) and on the device."""

    capacity: int
    host: torch.Tensor  # int64 [3 * capacity], pinned
    rows: np.ndarray  # numpy view of host
    device: torch.Tensor  # int64 [3 * capacity] where the kernel runs
    host_addr: int
    device_addr: int


def new_table_slot(capacity: int, device: torch.device) -> TableSlot:
    """A pinned host and a device buffer of ``3 * capacity`` int64 entries."""
    host = torch.empty(3 * capacity, dtype=torch.int64, pin_memory=True)
    table = torch.empty(3 * capacity, dtype=torch.int64, device=device)
    return TableSlot(capacity, host, host.numpy(), table, host.data_ptr(), table.data_ptr())


class TableSlots:
    """Free tables by size class (powers of two from 4,096 rows); thread-safe ``give``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._free: dict[int, list[TableSlot]] = {}
        self._lock = threading.Lock()
        self.num_allocated = 0

    def take(self, num_items: int) -> TableSlot:
        """A free slot of at least ``num_items`` rows (allocated if none is free)."""
        capacity = max(_MIN_ITEMS, 1 << (num_items - 1).bit_length())
        with self._lock:
            free = self._free.get(capacity)
            if free:
                return free.pop()
        self.num_allocated += 1
        return new_table_slot(capacity, self._device)

    def give(self, slot: TableSlot) -> None:
        """Return a slot whose batch has ended."""
        with self._lock:
            self._free.setdefault(slot.capacity, []).append(slot)


class KernelCopy:
    """Issues plans with one copy-kernel launch each.

    Args:
        device: the CUDA device the kernel runs on.
        driver: resolved entry points (the table upload is one ``cuMemcpyAsync``).
        d2h_programs, h2d_programs: program cap of a launch per direction (module
            ``kvmgr.kernels.copy_pages``; defaults 8 and 32: what a concurrent matmul loop loses
            is in docs/copy-kernel.md).
        chunk_bytes: descriptors above this are sliced so one merged run spreads over programs.
    """

    path = "kernel"

    def __init__(
        self,
        device: torch.device,
        driver: CopyDriver,
        *,
        d2h_programs: int = DEFAULT_D2H_PROGRAMS,
        h2d_programs: int = DEFAULT_H2D_PROGRAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.driver = driver
        self.programs = {Direction.D2H: d2h_programs, Direction.H2D: h2d_programs}
        self.chunk_bytes = chunk_bytes
        self.slots = TableSlots(device)

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Stage, upload and launch on ``stream``; a failed upload or launch is returned in
        ``error`` (the slot goes back to the pool after the end event all the same)."""
        sizes = plan.sizes
        n = len(sizes)
        if n == 0:
            return Issued("kernel", num_chunks=0)
        srcs, dsts = plan.src_addrs, plan.dst_addrs
        if sizes.min() <= 0 or sizes.max() > self.chunk_bytes:  # empty or sliced rows: rebuild
            table = build_descriptor_table(srcs, dsts, sizes, chunk_bytes=self.chunk_bytes)
            srcs, dsts, sizes = table
            n = table.shape[1]
            if n == 0:
                return Issued("kernel", num_chunks=0)
        slot = self.slots.take(n)
        rows = slot.rows
        rows[:n] = srcs
        rows[n : 2 * n] = dsts
        rows[2 * n : 3 * n] = sizes
        release = lambda: self.slots.give(slot)  # noqa: E731  (after the end event)
        try:
            self.driver.memcpy(slot.device_addr, slot.host_addr, 3 * n * _WORD, stream.cuda_stream)
            with torch.cuda.stream(stream):
                launch_copy_table(slot.device, n, self.programs[plan.direction])
        except Exception as exc:  # the future fails; the stream stays ordered
            error = TransferError(f"copy kernel launch failed: {exc}")
            return Issued("kernel", keep_alive=(slot,), release=release, error=error)
        return Issued("kernel", keep_alive=(slot,), release=release)
