"""The CPU tier's pinned memory, page-locked piece by piece, in the background if asked.

Offers:
    PinOptions      how to pin: in the background or not, piece sizes, first-touch threads,
                    transparent huge pages
    PinStatistics   what pinning did so far: bytes, pieces, seconds per phase, errors
    PinnedRegion    one region: allocated with ``mmap`` (huge-page advised), first touched by
                    a thread pool, registered piece by piece (``pin_plan.plan_pieces``)
    allocate_pages, first_touch   those two steps alone (``kvmgr bench pin`` times each phase;
                    re-exported from ``kvmgr.transfer.host_pages``)

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

import logging
import threading
import time
from collections.abc import Callable

import attrs

from kvmgr.errors import TransferError
from kvmgr.pool.host_pool import HostRegionLayout
from kvmgr.transfer.host_pages import Toucher, allocate_pages, first_touch
from kvmgr.transfer.pin_plan import PinOptions, PinPiece, plan_pieces
from kvmgr.transfer.pinned import HostRegistrar

__all__ = ["PinOptions", "PinStatistics", "PinnedRegion", "allocate_pages", "first_touch"]

_LOG = logging.getLogger(__name__)


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
        self._mmap, self.tensor, self._hugepages = allocate_pages(
            layout.num_bytes, options.hugepages
        )
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
        self._touch = Toucher(options.populate_threads)
        self._registrar: HostRegistrar | None = None
        self._start_pinning(registrar)

    # ------------------------------------------------------------------ pinning

    def _start_pinning(self, registrar: Callable[[], HostRegistrar]) -> None:
        """Pin the first piece (all of them unless ``background``) now, the rest on the
        pinning thread (raises as the constructor)."""
        num_now = 1 if self._options.background else len(self._pieces)
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
