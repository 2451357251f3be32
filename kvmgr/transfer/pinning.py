"""The CPU tier's pinned memory, page-locked piece by piece, in the background if asked.

Offers:
    PinOptions      how to pin: in the background or not, piece sizes, first-touch threads,
                    transparent huge pages
    PinStatistics   what pinning did so far: bytes, pieces, seconds per phase, errors
    PinnedRegion    one region: allocated with ``mmap`` (huge-page advised), first touched by
                    a thread pool, registered piece by piece (``pin_plan.plan_pieces``)
    allocate_pages, first_touch   those two steps alone (``kvmgr bench pin`` times each phase)

Where the start-up time went (docs/guides/pinned-tier.md has the measurements): the region was
``torch.empty`` (no page touched: allocation is free) and one ``cudaHostRegister`` over all of
it, so the driver faulted in and zeroed every 4 KiB page on one thread, then locked and mapped
it. Nothing in kvmgr zeroed or touched the region before: the only first touch was the
kernel's, inside the registration. What this module changes:

- first touch (``MADV_POPULATE_WRITE``, Linux >= 5.14; else one write per page) on
  ``populate_threads`` threads, for piece ``k + 1`` while piece ``k`` is being registered, so
  the kernel's page zeroing runs in parallel and off the registration;
- an ``mmap`` of its own (fresh pages, unmapped when the tier goes), optionally advised
  ``MADV_HUGEPAGE`` (2 MiB pages: 512 times fewer faults). Off by default: with the common
  ``defrag=madvise`` setting the advice makes every fault compact memory synchronously when no
  free huge page is at hand, which measured 5x *slower* first touch on our 2-core VM
  (``kvmgr bench pin`` compares both on the machine at hand);
- registration in pieces of at most 64 GiB (vllm #51080), the first small, then growing, so
  that blocks of the pinned pieces are usable while the rest is pinned (``num_blocks_ready``).

Never a block from unpinned memory: ``num_blocks_ready`` only counts blocks whose every page is
registered. If a piece fails, the tier stays at the pieces pinned so far (a smaller tier,
logged and in ``statistics().error``); with ``allow_pageable`` the rest becomes usable as
pageable memory after ``on_pageable()`` has told the engine (which then copies by DMA only).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

import attrs
import numpy as np
import torch

from kvmgr.errors import ConfigError, TransferError
from kvmgr.pool.host_pool import HostRegionLayout
from kvmgr.transfer.pin_plan import MAX_REGISTER_BYTES, PAGE_BYTES, PinPiece, plan_pieces
from kvmgr.transfer.pinned import HostRegistrar

__all__ = ["PinOptions", "PinStatistics", "PinnedRegion", "allocate_pages", "first_touch"]

_LOG = logging.getLogger(__name__)
_HUGE_BYTES = 2 << 20
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_TOUCH_CHUNK_BYTES = 256 << 20


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{attribute.name}: expected an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class PinOptions:
    """How the CPU tier is page-locked.

    Attributes:
        background: pin the first piece before returning and the rest on a background thread
            (blocks become usable piece by piece); ``False`` pins everything before returning.
        first_piece_bytes: size of the first piece (the blocks usable at once), bytes.
        max_piece_bytes: largest piece (at most 64 GiB: one registration never exceeds it).
        populate_threads: threads that first-touch the pages before registration; 0 lets the
            registration fault them in (one thread, in the driver).
        hugepages: advise transparent huge pages (``MADV_HUGEPAGE``) on the region (see the
            module docstring for why it is off by default).
    """

    background: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    first_piece_bytes: int = attrs.field(default=1 << 30, validator=_non_negative_int)
    max_piece_bytes: int = attrs.field(default=MAX_REGISTER_BYTES, validator=_non_negative_int)
    populate_threads: int = attrs.field(default=8, validator=_non_negative_int)
    hugepages: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if not PAGE_BYTES <= self.first_piece_bytes <= self.max_piece_bytes <= MAX_REGISTER_BYTES:
            raise ConfigError(
                f"expected {PAGE_BYTES} <= first_piece_bytes <= max_piece_bytes <= "
                f"{MAX_REGISTER_BYTES}, got {self.first_piece_bytes} and {self.max_piece_bytes}"
            )


@attrs.frozen(kw_only=True)
class PinStatistics:
    """Pinning of one region so far.

    Attributes:
        num_bytes / pinned_bytes / pageable_bytes: the region; bytes registered; bytes usable
            unpinned (after a failure with ``allow_pageable``).
        num_pieces / pieces_pinned: pieces planned / registered.
        num_blocks / blocks_ready: blocks of the tier / blocks usable now.
        alloc_s: seconds to allocate (``mmap`` and ``madvise``).
        populate_wait_s: seconds the pinning waited for first touch (what registration did not
            hide). register_s: seconds inside the registrations.
        pin_s: wall seconds from the start of the allocation to the last piece (so far).
        hugepages: whether ``MADV_HUGEPAGE`` was accepted.
        done: no more pieces will be pinned (all pinned, failed, or closed).
        error: why pinning stopped early, or ``None``.
    """

    num_bytes: int
    pinned_bytes: int
    pageable_bytes: int
    num_pieces: int
    pieces_pinned: int
    num_blocks: int
    blocks_ready: int
    alloc_s: float
    populate_wait_s: float
    register_s: float
    pin_s: float
    hugepages: bool
    done: bool
    error: str | None


class _PieceError(Exception):
    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"piece {index}: {cause}")
        self.index = index


class PinnedRegion:
    """The CPU tier's region, registered piece by piece (see the module docstring).

    Args:
        layout: where each tensor's pages lie (``HostKVPool``'s ``region_layout``).
        registrar: returns the register/unregister pair (``torch_registrar``); called once, on
            the constructor's thread. A ``RuntimeError`` from it counts as a failed piece 0.
        options: ``PinOptions``.
        allow_pageable: after a failed piece, make the rest usable unpinned (``on_pageable``
            first) instead of stopping there (background) or raising (before returning).
        on_pageable: called once, before any unpinned block becomes usable.
        thread_init: called first on the background thread (the engine selects its device).

    Attributes:
        tensor: ``uint8 [layout.num_bytes]``, 2 MiB-aligned; valid (pageable) after ``close``.
        num_blocks_ready: leading blocks whose pages are all registered (or usable pageable);
            written by the pinning thread, read anywhere; only grows.

    Raises:
        TransferError: the memory could not be allocated, or the pieces pinned before
            returning failed (and ``allow_pageable`` is false); nothing stays registered.
    """

    def __init__(
        self,
        layout: HostRegionLayout,
        registrar: Callable[[], HostRegistrar],
        options: PinOptions,
        *,
        allow_pageable: bool = False,
        on_pageable: Callable[[], None] | None = None,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self._options = options
        self._allow_pageable = allow_pageable
        self._on_pageable = on_pageable
        self._thread_init = thread_init
        self._start = time.perf_counter()
        self._mmap, self.tensor, self._hugepages = allocate_pages(layout.num_bytes, options.hugepages)
        self._alloc_s = time.perf_counter() - self._start
        self._base = self.tensor.data_ptr()
        self._pieces = plan_pieces(layout, first_piece_bytes=options.first_piece_bytes,
                                   max_piece_bytes=options.max_piece_bytes)  # fmt: skip
        self.num_blocks_ready = 0
        self._registered: list[int] = []  # addresses, in registration order
        self._num_pinned = self._pinned_bytes = self._pageable_bytes = 0
        self._populate_wait_s = self._register_s = 0.0
        self._end: float | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._touch = _Toucher(options.populate_threads)
        self._registrar: HostRegistrar | None = None
        num_now = 1 if options.background else len(self._pieces)
        try:
            self._registrar = registrar()
            self._pin(range(num_now))
        except (RuntimeError, _PieceError) as exc:
            self._failed(exc, raising=True)
        if self._num_pinned < len(self._pieces) and self._error is None:
            self._thread = threading.Thread(target=self._background, name="kvmgr-pin", daemon=True)
            self._thread.start()
        else:
            self._finish()

    # ------------------------------------------------------------------ pinning

    def _pin(self, indices: range) -> None:
        """Register the pieces ``indices`` in order; first touch of the next one overlaps."""
        pending = self._touch.start(self._base, self._pieces[indices[0]]) if indices else None
        for k in indices:
            waited = time.perf_counter()
            self._touch.wait(pending)
            self._populate_wait_s += time.perf_counter() - waited
            if self._stop.is_set():
                return
            following = k + 1 if k + 1 < len(self._pieces) else None
            pending = (
                None
                if following is None
                else self._touch.start(self._base, self._pieces[following])
            )
            self._register(k, self._pieces[k])

    def _register(self, k: int, piece: PinPiece) -> None:
        assert self._registrar is not None
        started = time.perf_counter()
        try:
            for offset, size in piece.ranges:
                self._registrar.register(self._base + offset, size)
                self._registered.append(self._base + offset)
                self._pinned_bytes += size
        except RuntimeError as exc:
            raise _PieceError(k, exc) from exc
        finally:
            self._register_s += time.perf_counter() - started
        self._num_pinned = k + 1
        self.num_blocks_ready = piece.end_block  # after every page of the piece is registered
        if len(self._pieces) > 1:
            _LOG.info(
                "CPU tier pinned %.1f of %.1f GiB (%d of %d pieces, %d blocks usable) in %.1f s",
                self._pinned_bytes / 2**30, self.layout.num_bytes / 2**30, k + 1,
                len(self._pieces), piece.end_block, time.perf_counter() - self._start,
            )  # fmt: skip

    def _background(self) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            self._pin(range(self._num_pinned, len(self._pieces)))
        except (RuntimeError, _PieceError) as exc:
            self._failed(exc, raising=False)
        finally:
            self._finish()

    def _failed(self, exc: BaseException, *, raising: bool) -> None:
        where = f"{self._num_pinned} of {len(self._pieces)} pieces pinned"
        self._error = f"could not page-lock the CPU tier ({where}): {exc}"
        if self._allow_pageable:
            if self._on_pageable is not None:
                self._on_pageable()
            self._pageable_bytes = self.layout.num_bytes - self._pinned_bytes
            self.num_blocks_ready = self.layout.num_blocks
            _LOG.warning("%s; the rest of the tier is pageable memory", self._error)
        elif raising:
            self._finish()
            self.close()
            raise TransferError(
                f"{self._error} (check `ulimit -l` and free memory, or pass allow_pageable=True "
                "to accept pageable memory at a fraction of the bandwidth)"
            ) from exc
        else:
            _LOG.warning("%s; the tier keeps the %d blocks pinned so far", self._error,
                         self.num_blocks_ready)  # fmt: skip

    def _finish(self) -> None:
        self._end = time.perf_counter()
        self._touch.close()

    # ------------------------------------------------------------------ queries, close

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until pinning stopped (done, failed or closed); ``False`` on timeout. Not for
        the event loop thread."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def statistics(self) -> PinStatistics:
        """A snapshot of the pinning so far (``PinStatistics``)."""
        end = self._end if self._end is not None else time.perf_counter()
        return PinStatistics(
            num_bytes=self.layout.num_bytes, pinned_bytes=self._pinned_bytes,
            pageable_bytes=self._pageable_bytes, num_pieces=len(self._pieces),
            pieces_pinned=self._num_pinned, num_blocks=self.layout.num_blocks,
            blocks_ready=self.num_blocks_ready, alloc_s=self._alloc_s,
            populate_wait_s=self._populate_wait_s, register_s=self._register_s,
            pin_s=end - self._start, hugepages=self._hugepages, done=self._end is not None,
            error=self._error,
        )  # fmt: skip

    def close(self) -> None:
        """Stop pinning (after the piece being registered), then unregister every piece.
        Idempotent; call only when no copy touches the region. The tensor stays valid.

        Raises:
            TransferError: an unregistration failed (the others were still attempted).
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        errors = []
        while self._registered:
            address = self._registered.pop()
            try:
                assert self._registrar is not None
                self._registrar.unregister(address)
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise TransferError(f"could not unregister the CPU tier: {'; '.join(errors)}")


class _Toucher:
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
    toucher = _Toucher(max(1, num_threads))
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
