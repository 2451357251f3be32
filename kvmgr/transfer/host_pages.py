"""Host pages for the pinned CPU tier: fresh mappings and their first touch (private to
``kvmgr.transfer``; ``kvmgr.transfer.pinning`` re-exports ``allocate_pages`` and ``first_touch``).

Offers:
    allocate_pages  a fresh, untouched, 2 MiB-aligned ``uint8`` CPU tensor over an anonymous
                    mapping, ``MADV_HUGEPAGE`` advised if asked
    first_touch     fault in every page of a CPU tensor on threads
    Toucher         the thread pool ``PinnedRegion`` populates piece ``k + 1`` with while piece
                    ``k`` is being registered

First touch is ``MADV_POPULATE_WRITE`` (Linux >= 5.14), else one write per page; the kernel's
page zeroing then runs on these threads instead of inside ``cudaHostRegister``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import mmap
import os
import sys

import numpy as np
import torch

from kvmgr.errors import TransferError
from kvmgr.transfer.pin_plan import PAGE_BYTES, PinPiece

__all__ = ["Toucher", "allocate_pages", "first_touch"]

_LOG = logging.getLogger(__name__)
_HUGE_BYTES = 2 << 20
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_TOUCH_CHUNK_BYTES = 256 << 20


class Toucher:
    """First touch of a piece's pages on a thread pool (``None`` futures when disabled)."""

    def __init__(self, num_threads: int) -> None:
        num_threads = min(num_threads, os.cpu_count() or 1)
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvmgr-touch")
            if num_threads and sys.platform == "linux"
            else None
        )
        self._num_threads = num_threads
        self._libc = ctypes.CDLL(None, use_errno=True) if self._pool is not None else None

    def start(self, base: int, piece: PinPiece) -> list[concurrent.futures.Future[None]] | None:
        if self._pool is None:
            return None
        return self.start_ranges([(base + offset, size) for offset, size in piece.ranges])

    def start_ranges(
        self, ranges: list[tuple[int, int]]
    ) -> list[concurrent.futures.Future[None]] | None:
        """Populate ``(address, num_bytes)`` ranges, split over the threads."""
        if self._pool is None or self._libc is None:
            return None
        libc = self._libc
        total = sum(size for _, size in ranges)
        chunk = max(_HUGE_BYTES, min(_TOUCH_CHUNK_BYTES, total // self._num_threads))
        chunk = -(-chunk // PAGE_BYTES) * PAGE_BYTES
        return [
            self._pool.submit(_populate, libc, address + at, min(chunk, size - at))
            for address, size in ranges
            for at in range(0, size, chunk)
        ]

    @staticmethod
    def wait(futures: list[concurrent.futures.Future[None]] | None) -> None:
        for future in futures or ():
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _populate(libc: ctypes.CDLL, address: int, num_bytes: int) -> None:
    """Fault in (write) the pages of a range: ``MADV_POPULATE_WRITE``, else a write per page
    (Linux < 5.14 answers ``EINVAL``; the pages belong to no usable block yet)."""
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(num_bytes),
                    _MADV_POPULATE_WRITE) == 0:  # fmt: skip
        return
    pages = np.ctypeslib.as_array((ctypes.c_uint8 * num_bytes).from_address(address))
    pages[::PAGE_BYTES] = 0


def first_touch(tensor: torch.Tensor, num_threads: int) -> None:
    """Fault in every page of a contiguous CPU tensor on ``num_threads`` threads (>= 1), as the
    pinning does before registering (for benchmarks and tools). Writes no byte where
    ``MADV_POPULATE_WRITE`` works; otherwise writes 0 to the first byte of each page."""
    toucher = Toucher(max(1, num_threads))
    try:
        toucher.wait(toucher.start_ranges([(tensor.data_ptr(), tensor.numel())]))
    finally:
        toucher.close()


def allocate_pages(num_bytes: int, hugepages: bool) -> tuple[mmap.mmap | None, torch.Tensor, bool]:
    """A fresh, untouched, 2 MiB-aligned ``uint8 [num_bytes]`` CPU tensor over an anonymous
    mapping (unmapped when the last view is gone), with ``MADV_HUGEPAGE`` if asked. Returns
    ``(mapping, tensor, whether the advice was accepted)``.

    Raises:
        TransferError: the mapping could not be made.
    """
    if sys.platform != "linux":
        return None, torch.empty(num_bytes, dtype=torch.uint8), False
    try:
        mapping = mmap.mmap(
            -1, num_bytes + _HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
    except (OSError, OverflowError, ValueError) as exc:
        raise TransferError(f"cannot map {num_bytes} B for the CPU tier: {exc}") from None
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -whole.data_ptr() % _HUGE_BYTES
    tensor = whole[offset : offset + num_bytes]
    advised = False
    if hugepages:
        libc = ctypes.CDLL(None, use_errno=True)
        length = -(-num_bytes // _HUGE_BYTES) * _HUGE_BYTES
        advised = libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(length),
                               _MADV_HUGEPAGE) == 0  # fmt: skip
        if not advised:
            _LOG.info("MADV_HUGEPAGE refused (%s): 4 KiB pages", os.strerror(ctypes.get_errno()))
    return mapping, tensor, advised
