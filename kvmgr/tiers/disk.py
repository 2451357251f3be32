"""The local disk tier: preallocated files of fixed-size slots, an LRU, I/O in a thread pool.

Offers:
    DiskTier   ``TierBackend`` over one or more preallocated files

Data structures: ``kvmgr.tiers._disk_slots.SlotTable`` (the LRU index of stored key -> slot,
free slots, pins of slots being read, keys being written).

Flow: ``put_many`` reserves slots (evicting LRU entries that no read pins), writes runs of
consecutive slots with one ``os.pwritev`` per run in worker threads, and only then enters the
keys into the index; a failed write frees its slots. ``get_many`` pins the slots, reads runs with
``os.preadv`` (the bridge verifies each blob), unpins. A call past its deadline
raises ``TierTimeoutError`` while its I/O finishes in the background and is committed or
released then (a timed-out write may still become readable).

Direct I/O: files open with ``O_DIRECT`` when ``direct=True`` and the filesystem accepts it
and an aligned probe read (tmpfs does not); otherwise buffered I/O. ``statistics().io_mode``
says which. Slot bytes are a multiple of 4 KiB; slot-sized blobs at 4 KiB-aligned addresses
(``TierBridge`` pads its rows so, see ``blob_alignment``) are written by ``pwritev`` as they
are, others through aligned staging buffers. Files and I/O: ``kvmgr.tiers._slot_files``;
the tier's writes, reads and index saves over them, errors as tier errors: ``_disk_io``.

Restart: ``aclose()`` saves the index beside the first file (``PATH.index``); the next
``DiskTier`` with the same geometry loads it and removes the file. A stale or torn entry cannot
give wrong KV (the checksum binds each blob to its key); it reads as ``corrupt``.

Faults (issue 26): the files are preallocated for real (``TierFullError`` when the disk has no
room for them, nothing left behind), locked against a second tier (``TierUnavailableError``), a
full disk during a write is ``TierFullError``; ``aclose`` waits at most ``deadline_s`` for I/O
in flight (a stuck disk: then it skips the index, lets the threads go and closes the files when
their last call returns, raising ``TierTimeoutError``), and on a full disk it still releases the
files and threads before raising ``TierFullError``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvmgr.errors import (
    InvalidArgumentError,
    TierError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvmgr.tiers._disk_config import check_config, check_sizes
from kvmgr.tiers._disk_index import load_index
from kvmgr.tiers._disk_io import (
    DiskIO,
    fold_reads,
    open_slot_files,
    plan_writes,
    read_and_release,
    save_index_or_error,
    write_and_commit,
)
from kvmgr.tiers._disk_slots import SlotTable
from kvmgr.tiers._slot_files import ALIGN_BYTES, MAX_RUN_BYTES
from kvmgr.tiers.base import (
    Buffer,
    PutResult,
    TierCounters,
    TierStatistics,
    blob_views,
    check_keys,
    with_deadline,
)

__all__ = ["ALIGN_BYTES", "DiskTier"]


class DiskTier:
    """kvmgr blobs (``kvmgr.tiers.blob``, what ``TierBridge`` writes) in fixed-size slots of
    preallocated files, LRU-evicted; any other value is stored but reads back as a miss.

    Args:
        path: first file; more files (``num_files > 1``) get ``.1``, ``.2``, ... appended.
        slot_bytes: bytes of the largest blob (rounded up to 4 KiB), e.g.
            ``TierNamespace.blob_bytes``.
        num_slots: slots in all files together (capacity = ``num_slots * slot_bytes``).
        num_files: files the slots are striped over (slot ``s`` in file ``s % num_files``).
        direct: try ``O_DIRECT``.
        io_threads: worker threads for reads and writes.
        deadline_s: deadline of every call (seconds).
        persist_index: save the index on ``aclose`` and load it on open.

    Raises:
        ConfigError: sizes that are not ints >= 1, more files than slots, a file over 2**62
            bytes, ``direct`` / ``persist_index`` not a bool, a deadline that is not a finite
            number > 0.
        TierFullError: the filesystem has no room for the preallocated files.
        TierUnavailableError: a file cannot be created, or another open ``DiskTier`` (in this
            or another process) holds it.
    """

    name = "disk"
    #: blobs padded to this many bytes at 4 KiB-aligned addresses are written without a copy
    #: (``TierBridge`` pads its rows to it); only meaningful in direct mode.
    blob_alignment = ALIGN_BYTES
    #: ``TierBridge`` hands batches over in chunks of about this many bytes, to overlap its
    #: gather/scatter of one chunk with the I/O of the others.
    chunk_bytes = MAX_RUN_BYTES

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        slot_bytes: int,
        num_slots: int,
        num_files: int = 1,
        direct: bool = True,
        io_threads: int = 4,
        deadline_s: float = 5.0,
        persist_index: bool = True,
    ) -> None:
        check_config(path, slot_bytes, num_slots, num_files, io_threads, deadline_s)
        check_sizes(slot_bytes, num_slots, num_files, direct, persist_index)  # type: ignore[arg-type]
        self.slot_bytes = -(-slot_bytes // ALIGN_BYTES) * ALIGN_BYTES
        self.num_slots = num_slots
        self._paths = [Path(path)] + [Path(f"{path}.{i}") for i in range(1, num_files)]
        self._deadline_s = deadline_s
        self._persist = persist_index
        self._files = open_slot_files(self._paths, self.slot_bytes, num_slots, direct)
        self.is_direct = self._files.is_direct
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvmgr-disk")
        self._inflight: set[asyncio.Task[object]] = set()
        mode = "direct" if self.is_direct else "buffered"
        self._counters = TierCounters(name="disk", io_mode=mode)
        self._closed = False
        saved = None
        if persist_index:
            saved = load_index(self._index_path(), self._geometry(), num_slots, self.slot_bytes)
        self._slots = SlotTable(num_slots, saved)
        self._io = DiskIO(self._files, self._pool, self._slots, self._counters)

    def __repr__(self) -> str:
        return (
            f"DiskTier({os.fspath(self._paths[0])!r}, slots={self.num_slots} x "
            f"{self.slot_bytes} B, {self._counters.io_mode}, {self.num_used} used)"
        )

    @property
    def num_used(self) -> int:
        """Slots holding a readable blob."""
        return len(self._slots.index)

    # ---- the protocol -------------------------------------------------------------------

    async def put_many(self, keys: Sequence[bytes], blobs: Sequence[Buffer]) -> PutResult:
        """Write the blobs into free or LRU-evicted slots; see ``TierBackend.put_many``.

        Keys already stored (or being written) are not rewritten and count as stored; blobs
        that find no slot (every slot pinned by reads) are not stored and count as ``num_full``.

        Raises:
            InvalidKeyError: keys not distinct bytes, or one blob per key missing.
            InvalidArgumentError: a blob is not a C-contiguous buffer, or larger than
                ``slot_bytes``.
        """
        keys = check_keys(keys, distinct=True)
        views = blob_views(blobs, len(keys))
        too_big = [v.nbytes for v in views if v.nbytes > self.slot_bytes]
        if too_big:
            raise InvalidArgumentError(f"blob of {too_big[0]} B > slot_bytes {self.slot_bytes}")
        self._check_open()
        start = time.perf_counter()
        stored = np.zeros(len(keys), dtype=bool)
        writes, positions = plan_writes(self._io, keys, views, stored)
        self._slots.pending.update(w[1] for w in writes)
        task = asyncio.ensure_future(write_and_commit(self._io, writes, self._write_run))
        self._track(task)
        try:
            await with_deadline(asyncio.shield(task), self._deadline_s, "disk put_many")
        except TierTimeoutError as exc:
            self._counters.num_timeouts += 1
            self._counters.last_error = str(exc)
            raise
        finally:
            self._counters.add_put_time(time.perf_counter() - start)
        stored[positions] = True
        num_bytes = sum(w[3] for w in writes)
        return PutResult(stored, int(stored.sum()), num_bytes, time.perf_counter() - start)

    async def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Read the blobs (header checked, the bridge verifies the rest); see ``TierBackend``."""
        keys = check_keys(keys)
        self._check_open()
        start = time.perf_counter()
        reads = self._slots.pin_reads(keys)
        task = asyncio.ensure_future(read_and_release(self._io, reads))
        self._track(task)
        try:
            results, num_failed = await with_deadline(
                asyncio.shield(task), self._deadline_s, "disk get_many"
            )
        except TierTimeoutError as exc:
            self._counters.num_timeouts += 1
            self._counters.num_misses += len(keys)
            self._counters.last_error = str(exc)
            raise
        finally:
            self._counters.add_get_time(time.perf_counter() - start)
        return fold_reads(self._io, len(keys), reads, results, num_failed)

    async def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """bool ``[n]`` from the in-memory index (no I/O)."""
        keys = check_keys(keys)
        index = self._slots.index
        return np.fromiter((k in index for k in keys), dtype=bool, count=len(keys))

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Drop the keys and free their slots (after in-flight reads; in-flight writes: unindexed)."""
        return sum(self._slots.drop(key) for key in check_keys(keys))

    async def aclose(self) -> None:
        """Wait (at most ``deadline_s``) for in-flight I/O, save the index (``persist_index``),
        close the files and stop the threads; idempotent. The files and threads are released
        whatever happens.

        Raises:
            TierTimeoutError: I/O was still stuck after ``deadline_s`` (a stuck disk): the index
                was not saved (the tier restarts empty) and the files close when the stuck calls
                return.
            TierFullError: the index could not be saved for lack of space (no partial file is
                left; the tier restarts empty).
            TierError: the index could not be saved otherwise.
        """
        if self._closed:
            return
        self._closed = True
        stuck = False
        if self._inflight:
            _done, pending = await asyncio.wait(list(self._inflight), timeout=self._deadline_s)
            stuck = bool(pending)
        error: TierError | None = None
        try:
            if stuck:
                error = TierTimeoutError(
                    f"disk tier {os.fspath(self._paths[0])}: I/O still stuck after "
                    f"{self._deadline_s:g} s at close; index not saved"
                )
            elif self._persist:
                error = save_index_or_error(self._index_path(), self._geometry(), self._slots.index)
        finally:
            self._pool.shutdown(wait=not stuck, cancel_futures=True)
            self._files.close()  # (deferred to the last stuck call's return)
        if error is not None:
            self._counters.last_error = str(error)
            raise error

    def statistics(self) -> TierStatistics:
        """Totals since construction (``io_mode`` ``"direct"`` or ``"buffered"``)."""
        return self._counters.snapshot()

    # ---- I/O ------------------------------------------------------------------------------

    def _write_run(self, file: int, offset: int, views: list[memoryview]) -> None:
        """One run's write, in a worker thread (a method, so tests can stall the device)."""
        self._files.pwrite_run(file, offset, views)

    # ---- files and the saved index ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError("disk tier is closed")

    def _track(self, task: asyncio.Task[object]) -> None:
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieve, no warning

    def _index_path(self) -> Path:
        return Path(f"{self._paths[0]}.index")

    def _geometry(self) -> list[int]:
        return [self.slot_bytes, self.num_slots, len(self._paths)]
