"""The copy kernels' host staging for the engines: tables into pooled pinned slots, one upload,
one packed launch on a given stream.

Offers (to :class:`kvmgr.transfer.kernel.KernelCopy`):
    CopyStager      ``copy_runs`` (the paged kernel) / ``copy_descriptors`` (the descriptor
                    kernel): a whole plan's copies in one launch on the caller's stream
    Staged          what one of those left in flight: buffers to keep, how to release them, the
                    error of a refused upload or launch
    TableSlots      the pool of reusable (pinned host, device) table buffers
    TableSlot, new_table_slot   one such buffer (module-level so CPU tests can stand in for CUDA)

Per call, O(runs) or O(descriptors) of numpy and three driver calls at most:

- **runs** (:mod:`kvmgr.kernels.copy.blocks`): the pair of layouts' ``[5, tensors]`` table is
  built and uploaded once per (stream, source layout, destination layout) and kept on the device
  (the last ``_MAX_LAYOUTS`` pairs); the runs, long ones split at ``chunk_bytes`` of the largest
  page, are written as a packed ``[3, rows]`` table into a slot, uploaded with one
  ``cuMemcpyAsync`` on the stream and launched there. The plan's descriptors are never built.
- **descriptors** (:mod:`kvmgr.kernels.copy.pages`): the descriptors as a packed ``[3, n]`` table
  (three numpy copies; sliced above ``chunk_bytes`` first) in the same kind of slot.

Both launch through this stager's own packed launches of each kernel
(:class:`~kvmgr.kernels.launch.Launches`): the copy stream is an argument, so there is no
``torch.cuda.stream`` context (~11 us on the H200 host) and no Triton launcher per batch. A slot
stays in use until its batch's end event: the caller keeps ``Staged.keep_alive`` alive and calls
``Staged.release`` on the completion thread (rule 7), so a steady stream of batches allocates
nothing. The kernels dereference host addresses: every host page must be pinned or registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr._size_pool import SizePool
from kvmgr.kernels.copy.blocks import block_table_launches, launch_block_table
from kvmgr.kernels.copy.pages import copy_table_launches, launch_copy_table
from kvmgr.kernels.copy.row import DEFAULT_CHUNK_BYTES
from kvmgr.kernels.copy.tables import (
    build_descriptor_table,
    build_layout_table,
    build_run_table,
    max_run_blocks,
)
from kvmgr.kernels.launch import Launches
from kvmgr.pool.layout import KVLayout

__all__ = ["CopyStager", "Staged", "TableSlot", "TableSlots", "new_table_slot"]

_MIN_ITEMS = 4096  # smallest slot: 96 KiB of table each side
_WORD = 8
_MAX_LAYOUTS = 16  # layout tables kept on the device (a manager uses two: one per direction)
#: ``upload(dst_address, src_address, num_bytes, stream_handle)``: one host->device copy enqueued
#: on the stream (``CopyDriver.memcpy``)
Upload = Callable[[int, int, int, int], None]


@attrs.define(eq=False)
class TableSlot:
    """One reusable table: ``capacity`` rows on the host (pinned) and on the device."""

    capacity: int
    host: torch.Tensor  # int64 [3 * capacity], pinned
    rows: np.ndarray  # numpy view of host
    device: torch.Tensor  # int64 [3 * capacity] where the kernel runs
    host_addr: int
    device_addr: int
    ones: int = 0  # rows[2 * ones : 3 * ones] hold 1s (its last table: that many one-block runs)


def new_table_slot(capacity: int, device: torch.device) -> TableSlot:
    """A pinned host and a device buffer of ``3 * capacity`` int64 entries."""
    host = torch.empty(3 * capacity, dtype=torch.int64, pin_memory=True)
    table = torch.empty(3 * capacity, dtype=torch.int64, device=device)
    return TableSlot(capacity, host, host.numpy(), table, host.data_ptr(), table.data_ptr())


class TableSlots(SizePool[TableSlot]):
    """Free tables by size class (powers of two from 4,096 rows); thread-safe ``give``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # new_table_slot looked up per call: CPU tools substitute it (scripts/_fake_cuda.py)
        super().__init__(lambda capacity: new_table_slot(capacity, device), _MIN_ITEMS)


@attrs.define
class Staged:
    """What one staged copy left in flight.

    Not frozen (a frozen attrs ``__init__`` costs ~3x on the step's path): read-only by use.

    Attributes:
        num_launches: kernel launches enqueued (0 or 1).
        keep_alive: buffers the device may still read until the batch's end event.
        release: call once after that event (gives the slot back), or None.
        error: the refused upload or launch, or None; ``failed`` names which.
    """

    num_launches: int
    keep_alive: tuple[Any, ...] = ()
    release: Callable[[], None] | None = None
    error: Exception | None = None
    failed: str = ""


@attrs.frozen(eq=False)
class _LayoutTable:
    """A pair of layouts' ``[5, num_tensors]`` table, in a slot that is never given back."""

    slot: TableSlot
    num_tensors: int
    max_blocks: int  # blocks per work item (max_run_blocks)


class CopyStager:
    """One issuer's staged copy-kernel launches on the streams it is given.

    Args:
        device: the CUDA device the kernels run on.
        upload: enqueues one host->device copy on a stream (``CopyDriver.memcpy``).
        chunk_bytes: descriptors above this are sliced, and runs above this many bytes of the
            largest page are split, so one merged run spreads over programs.

    Raises:
        TransferError: Triton is not installed (at the first copy).
    """

    def __init__(self, device: torch.device, upload: Upload, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:  # fmt: skip
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.slots = TableSlots(device)
        self._upload = upload
        # (stream handle, src, dst) -> table; the key holds the layouts, so ids are not reused
        self._layouts: dict[tuple[int, KVLayout, KVLayout], _LayoutTable] = {}
        self._runs: Launches | None = None  # this stager's packed launches, made on first use
        self._descriptors: Launches | None = None

    def copy_runs(
        self, src: KVLayout, dst: KVLayout, run_src_ids: np.ndarray, run_dst_ids: np.ndarray,
        run_lengths: np.ndarray | None, max_programs: int, stream: Any, *,
        max_run: int | None = None,
    ) -> Staged:  # fmt: skip
        """Copy blocks ``run_src_ids[r] + k -> run_dst_ids[r] + k`` (``k < run_lengths[r]``;
        ``None``: one block per run) of every tensor from ``src`` to ``dst`` with one paged-kernel
        launch on ``stream``. ``max_run``, if given, is the longest run (no run that needs
        splitting is looked for). ``src`` and ``dst`` must be addressable by the kernel (device
        memory of this device, pinned or registered host memory) with equal page bytes per
        tensor; the runs must lie in both caches and not overlap (the plan's checks). A refused
        upload or launch is returned in ``Staged.error``; nothing raises after a slot was taken."""
        layout = self._layouts.get((stream.cuda_stream, src, dst))
        if layout is None:
            try:
                layout = self._layout_table(src, dst, stream)
            except Exception as exc:  # the upload of a new layout table was refused
                return Staged(0, error=exc, failed="layout upload")
        n = len(run_src_ids)
        if max_run is None:
            max_run = 1 if run_lengths is None else int(run_lengths.max(initial=1))
        if max_run > layout.max_blocks:  # long runs, split first
            slot, n = self._split_runs(run_src_ids, run_dst_ids, run_lengths, layout.max_blocks)
        else:  # the common case: each run is one row
            slot = self.slots.take(n)
            rows = slot.rows
            rows[:n] = run_src_ids
            rows[n : 2 * n] = run_dst_ids
            if run_lengths is not None:
                rows[2 * n : 3 * n] = run_lengths
                slot.ones = 0
            elif slot.ones != n:  # (else: the 1s of this slot's last table of n one-block runs)
                rows[2 * n : 3 * n] = 1
                slot.ones = n
        launches = self._runs
        if launches is None:
            launches = self._runs = block_table_launches()
        return self._launch(slot, (layout.slot, slot), n, stream, launch_block_table,
                            (layout.slot.device, slot.device, layout.num_tensors, n, max_programs),
                            launches)  # fmt: skip

    def _split_runs(self, run_src_ids: np.ndarray, run_dst_ids: np.ndarray, run_lengths: np.ndarray | None, max_blocks: int) -> tuple[TableSlot, int]:  # fmt: skip
        """A slot holding the runs split at ``max_blocks`` blocks, and its row count."""
        n = len(run_src_ids)
        lengths = np.ones(n, dtype=np.int64) if run_lengths is None else run_lengths
        table = build_run_table(run_src_ids, run_dst_ids, lengths, max_blocks)
        n = table.shape[1]
        slot = self.slots.take(n)
        slot.rows[: 3 * n] = table.reshape(-1)
        slot.ones = 0
        return slot, n

    def copy_descriptors(
        self, src_addrs: np.ndarray, dst_addrs: np.ndarray, sizes: np.ndarray, max_programs: int,
        stream: Any,
    ) -> Staged:  # fmt: skip
        """Copy ``sizes[i]`` bytes ``src_addrs[i] -> dst_addrs[i]`` (int64 ``[n]`` each, checked
        by the plan) with one descriptor-kernel launch on ``stream``; as :meth:`copy_runs`."""
        n = len(sizes)
        if n == 0:
            return Staged(0)
        if sizes.min() <= 0 or sizes.max() > self.chunk_bytes:  # empty or sliced rows: rebuild
            table = build_descriptor_table(src_addrs, dst_addrs, sizes, chunk_bytes=self.chunk_bytes)  # fmt: skip
            src_addrs, dst_addrs, sizes = table
            n = table.shape[1]
            if n == 0:
                return Staged(0)
        slot = self.slots.take(n)
        rows = slot.rows
        rows[:n] = src_addrs
        rows[n : 2 * n] = dst_addrs
        rows[2 * n : 3 * n] = sizes
        slot.ones = 0
        if self._descriptors is None:
            self._descriptors = copy_table_launches()
        return self._launch(slot, (slot,), n, stream, launch_copy_table,
                            (slot.device, n, max_programs), self._descriptors)  # fmt: skip

    def _launch(self, slot: TableSlot, keep: tuple[Any, ...], n: int, stream: Any, launch: Callable[..., int], args: tuple[Any, ...], launches: Launches) -> Staged:  # fmt: skip
        """Upload the slot's ``[3, n]`` table on ``stream``, then ``launch(*args)`` there."""
        release = lambda: self.slots.give(slot)  # noqa: E731  (after the end event)
        try:
            self._upload(slot.device_addr, slot.host_addr, 3 * n * _WORD, stream.cuda_stream)
            launch(*args, stream=stream, launches=launches)
        except Exception as exc:  # the batch fails; the stream stays ordered
            return Staged(1, keep, release, exc, "launch")
        return Staged(1, keep, release)

    def _layout_table(self, src: KVLayout, dst: KVLayout, stream: Any) -> _LayoutTable:
        """The pair's layout table on the device: uploaded on ``stream`` the first time the pair
        is copied there (so in stream order before every launch that reads it), then kept."""
        key = (stream.cuda_stream, src, dst)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        values = build_layout_table(src, dst)
        num_tensors = values.shape[1]
        slot = new_table_slot(-(-5 * num_tensors // 3), self.device)
        slot.rows[: 5 * num_tensors] = values.reshape(-1)
        self._upload(slot.device_addr, slot.host_addr, 5 * num_tensors * _WORD, stream.cuda_stream)
        table = _LayoutTable(slot, num_tensors, max_run_blocks(src.page_bytes, self.chunk_bytes))
        if len(self._layouts) >= _MAX_LAYOUTS:  # the oldest; batches in flight keep its slot
            del self._layouts[next(iter(self._layouts))]
        self._layouts[key] = table
        return table
