"""The copy-kernel issuer: a whole plan in one copy-kernel launch.

Offers:
    KernelCopy      ``issue(plan, stream)``: table into a reusable pinned slot, one upload, one launch
    TableSlots      the pool of reusable (pinned host, device) table buffers
    new_table_slot  allocate one slot (module-level so CPU tests can stand in for CUDA memory)

Two paths, one launch each:

- **paged** (``kvmgr.kernels.copy_blocks``), for a plan from ``build_plan`` (no descriptor array
  given or edited: ``TransferPlan.is_from_blocks``) whose layouts the kernel can address (CPU, or the issuer's CUDA device): the plan's runs
  of blocks are written into a pinned host buffer as a packed ``[3, runs]`` table (first source
  block, first destination block, blocks; runs above ``chunk_bytes`` of the largest page split
  first), uploaded with one ``cuMemcpyAsync`` on the copy stream, and the kernel computes every
  page address from a ``[5, tensors]`` layout table. That table is built and uploaded once per
  (copy stream, source layout, destination layout) and kept on the device (the last
  ``_MAX_LAYOUTS`` pairs). Host work per plan is O(runs); the plan's descriptors are never built.
- **descriptors** (``kvmgr.kernels.copy_pages``), for any other plan (hand-made, edited, split):
  its descriptors as a packed ``[3, n]`` table (sources, destinations, bytes) in the same kind of
  slot, sliced above ``chunk_bytes`` first (``build_descriptor_table``) so one merged run spreads
  over every program.

Both launch on the copy stream with the launchers that skip Triton's per-call dispatch. Slots come
from a pool and go back to it on the completion thread after the batch's end event (rule 7), so a
steady stream of batches allocates nothing.

The kernels dereference host addresses, so every host page must be pinned or registered.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import TransferError
from kvmgr.kernels.copy_blocks import (
    block_table_launches,
    build_layout_table,
    build_run_table,
    launch_block_table,
    max_run_blocks,
)
from kvmgr.kernels.copy_pages import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_D2H_PROGRAMS,
    DEFAULT_H2D_PROGRAMS,
    build_descriptor_table,
    copy_table_launches,
    launch_copy_table,
)
from kvmgr.kernels.table_launch import TableLaunches
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import BlockPairs, Direction, TransferPlan
from kvmgr.transfer.streams import Issued

__all__ = ["KernelCopy", "TableSlots", "new_table_slot"]

_MIN_ITEMS = 4096  # smallest slot: 96 KiB of table each side
_WORD = 8
_MAX_LAYOUTS = 16  # layout tables kept on the device (a manager uses two: one per direction)


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
        self.device = device
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
        return new_table_slot(capacity, self.device)

    def give(self, slot: TableSlot) -> None:
        """Return a slot whose batch has ended."""
        with self._lock:
            self._free.setdefault(slot.capacity, []).append(slot)


@attrs.frozen(eq=False)
class _LayoutTable:
    """A pair of layouts' ``[5, num_tensors]`` table, in a slot that is never given back."""

    slot: TableSlot
    num_tensors: int
    max_blocks: int  # blocks per work item (max_run_blocks)


class KernelCopy:
    """Issues plans with one copy-kernel launch each.

    Args:
        device: the CUDA device the kernel runs on.
        driver: resolved entry points (the table upload is one ``cuMemcpyAsync``).
        d2h_programs, h2d_programs: program cap of a launch per direction (module
            ``kvmgr.kernels.copy_pages``; defaults 12 and 32: what a concurrent matmul loop loses
            is in docs/copy-kernel.md).
        chunk_bytes: descriptors above this are sliced, and runs above this many bytes of the
            largest page are split, so one merged run spreads over programs.
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
        self.device = device
        self.programs = {Direction.D2H: d2h_programs, Direction.H2D: h2d_programs}
        self.chunk_bytes = chunk_bytes
        self.slots = TableSlots(device)
        # (stream handle, src, dst) -> table; the key holds the layouts, so ids are not reused
        self._layouts: dict[tuple[int, KVLayout, KVLayout], _LayoutTable] = {}
        self._table_launches: dict[str, TableLaunches] = {}

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Stage, upload and launch on ``stream`` (paged for a plan from ``build_plan`` whose
        layouts the kernel can address, else from the descriptors); a failed upload or launch is
        returned in ``error`` (the slot goes back to the pool after the end event all the same).

        A plan given any descriptor array (by hand, ``attrs.evolve``, ``split``) is copied from
        its descriptors even where its counts still match ``blocks``: they are what it says."""
        pairs = plan.matching_blocks()
        if pairs is not None and self._addressable(pairs.src) and self._addressable(pairs.dst):
            return self._issue_runs(plan.direction, pairs, stream)
        return self._issue_descriptors(plan, stream)

    def _launches(self, kind: str) -> TableLaunches:
        """This issuer's packed launches of the paged (``"blocks"``) or the descriptor-table
        kernel on an explicit stream, made on first use (``kvmgr.kernels.table_launch``).

        Raises:
            TransferError: Triton is not installed.
        """
        launches = self._table_launches.get(kind)
        if launches is None:
            launches = block_table_launches() if kind == "blocks" else copy_table_launches()
            self._table_launches[kind] = launches
        return launches

    def _addressable(self, layout: KVLayout) -> bool:
        """Host memory (pinned or registered: the engine sends pageable tiers to DMA) or this
        issuer's device."""
        device = layout.device
        if device.type == "cpu":
            return True
        return device.type == self.device.type and device.index in (None, self.device.index)

    def _issue_runs(self, direction: Direction, pairs: BlockPairs, stream: Any) -> Issued:
        """The paged path: the run table into a slot, one upload, one launch."""
        try:
            layout = self._layout_table(pairs.src, pairs.dst, stream)
        except Exception as exc:  # the upload of a new layout table was refused
            error = TransferError(f"copy kernel layout upload failed: {exc}")
            return Issued("kernel", num_chunks=0, error=error)
        table = build_run_table(pairs.run_src_ids, pairs.run_dst_ids, pairs.run_lengths,
                                layout.max_blocks)  # fmt: skip
        n = table.shape[1]
        slot = self.slots.take(n)
        slot.rows[: 3 * n] = table.reshape(-1)
        release = lambda: self.slots.give(slot)  # noqa: E731  (after the end event)
        keep = (layout.slot, slot)
        try:
            self.driver.memcpy(slot.device_addr, slot.host_addr, 3 * n * _WORD, stream.cuda_stream)
            launch_block_table(layout.slot.device, slot.device, layout.num_tensors, n,
                               self.programs[direction], stream=stream,
                               launches=self._launches("blocks"))  # fmt: skip
        except Exception as exc:  # the future fails; the stream stays ordered
            error = TransferError(f"copy kernel launch failed: {exc}")
            return Issued("kernel", keep_alive=keep, release=release, error=error)
        return Issued("kernel", keep_alive=keep, release=release)

    def _layout_table(self, src: KVLayout, dst: KVLayout, stream: Any) -> _LayoutTable:
        """The pair's layout table on the device: uploaded on ``stream`` the first time the pair
        is issued there (so in stream order before every launch that reads it), then cached."""
        key = (stream.cuda_stream, src, dst)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        values = build_layout_table(src, dst)
        num_tensors = values.shape[1]
        slot = new_table_slot(-(-5 * num_tensors // 3), self.device)
        slot.rows[: 5 * num_tensors] = values.reshape(-1)
        self.driver.memcpy(slot.device_addr, slot.host_addr, 5 * num_tensors * _WORD,
                           stream.cuda_stream)  # fmt: skip
        table = _LayoutTable(slot, num_tensors, max_run_blocks(src.page_bytes, self.chunk_bytes))
        if len(self._layouts) >= _MAX_LAYOUTS:  # the oldest; batches in flight keep its slot
            del self._layouts[next(iter(self._layouts))]
        self._layouts[key] = table
        return table

    def _issue_descriptors(self, plan: TransferPlan, stream: Any) -> Issued:
        """The descriptor path: the plan's descriptors into a slot, one upload, one launch."""
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
            launch_copy_table(slot.device, n, self.programs[plan.direction], stream=stream,
                              launches=self._launches("descriptors"))  # fmt: skip
        except Exception as exc:  # the future fails; the stream stays ordered
            error = TransferError(f"copy kernel launch failed: {exc}")
            return Issued("kernel", keep_alive=(slot,), release=release, error=error)
        return Issued("kernel", keep_alive=(slot,), release=release)
