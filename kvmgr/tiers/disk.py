"""The local disk tier: preallocated files of fixed-size slots, an LRU, I/O in a thread pool.

Offers:
    DiskTier   ``TierBackend`` over one or more preallocated files

Data structures: ``_index`` (OrderedDict stored key -> (slot, blob bytes), least recently used
first), ``_free`` (free slot ids; fresh ids ascending first so a batch lands in consecutive
slots, then freed ids last-freed-first), ``_pins`` (slot -> reads in flight; pinned slots are
never evicted or reused), ``_pending`` (keys whose write is in flight: not readable).

Flow: ``put_many`` reserves slots (evicting LRU entries that no read pins), writes runs of
consecutive slots with one ``os.pwritev`` per run in worker threads, and only then enters the
keys into the index; a failed write frees its slots. ``get_many`` pins the slots, reads runs with
``os.preadv`` and verifies each blob's checksum in the worker, unpins. A call past its deadline
raises ``TierTimeoutError`` while its I/O finishes in the background and is committed or
released then (a timed-out write may still become readable).

Direct I/O: files open with ``O_DIRECT`` when ``direct=True`` and the filesystem accepts an
aligned probe write (tmpfs and some overlay filesystems do not); otherwise buffered I/O.
``statistics().io_mode`` says which. Direct I/O goes through page-aligned ``mmap`` staging
buffers and whole slots; slot bytes are a multiple of 4 KiB.

Restart: ``aclose()`` saves the index beside the first file (``PATH.index``); the next
``DiskTier`` with the same geometry loads it and removes the file. A stale or torn entry cannot
give wrong KV (the checksum binds each blob to its key); it reads as ``corrupt``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvmgr.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    TierError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvmgr.tiers.base import (
    Buffer,
    PutResult,
    TierCounters,
    TierStatistics,
    check_keys,
    with_deadline,
)
from kvmgr.tiers.blob import blob_length, verify

__all__ = ["ALIGN_BYTES", "DiskTier"]

#: slot size and direct-I/O alignment.
ALIGN_BYTES = 4096
#: a run of consecutive slots is one pwritev/preadv of at most this many bytes; several runs go
#: to the worker threads at once, so one run's copy overlaps another's device transfer.
_MAX_RUN_BYTES = 4 << 20
_INDEX_VERSION = 1


class DiskTier:
    """Blobs in fixed-size slots of preallocated files, LRU-evicted.

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
        ConfigError: non-positive sizes.
        TierUnavailableError: a file cannot be created or preallocated.
    """

    name = "disk"
    #: blobs padded to this many bytes at 4 KiB-aligned addresses are written without a copy
    #: (``TierBridge`` pads its rows to it); only meaningful in direct mode.
    blob_alignment = ALIGN_BYTES

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
        if min(slot_bytes, num_slots, num_files, io_threads) < 1 or deadline_s <= 0:
            raise ConfigError(
                "DiskTier: expected slot_bytes, num_slots, num_files, io_threads >= 1"
            )
        self.slot_bytes = -(-slot_bytes // ALIGN_BYTES) * ALIGN_BYTES
        self.num_slots = num_slots
        self._paths = [Path(path)] + [Path(f"{path}.{i}") for i in range(1, num_files)]
        self._deadline_s = deadline_s
        self._persist = persist_index
        slots_per_file = -(-num_slots // num_files)
        self._fds: list[int] = []
        modes: list[bool] = []
        try:
            for p in self._paths:
                fd, is_direct = _open(p, slots_per_file * self.slot_bytes, direct)
                self._fds.append(fd)
                modes.append(is_direct)
        except OSError as exc:
            for fd in self._fds:
                os.close(fd)
            raise TierUnavailableError(f"disk tier {path}: {exc.strerror}") from None
        is_direct = all(modes)
        if any(modes) and not is_direct:
            self._reopen_buffered()
        self.is_direct = is_direct
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvmgr-disk")
        self._index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._pending: set[bytes] = set()
        self._inflight: set[asyncio.Task[object]] = set()
        self._max_run_slots = max(1, _MAX_RUN_BYTES // self.slot_bytes)
        self._spare_buffers: list[mmap.mmap] = []  # aligned write staging, reused
        self._counters = TierCounters(name="disk", io_mode="direct" if is_direct else "buffered")
        self._closed = False
        if persist_index:
            self._load_index()

    def __repr__(self) -> str:
        return (
            f"DiskTier({os.fspath(self._paths[0])!r}, slots={self.num_slots} x "
            f"{self.slot_bytes} B, {self._counters.io_mode}, {len(self._index)} used)"
        )

    @property
    def num_used(self) -> int:
        """Slots holding a readable blob."""
        return len(self._index)

    # ---- the protocol -------------------------------------------------------------------

    async def put_many(self, keys: Sequence[bytes], blobs: Sequence[Buffer]) -> PutResult:
        """Write the blobs into free or LRU-evicted slots; see ``TierBackend.put_many``.

        Keys already stored (or being written) are not rewritten and count as stored; blobs
        that find no slot (every slot pinned by reads) are not stored and count as ``num_full``.

        Raises:
            InvalidArgumentError: a blob is larger than ``slot_bytes``.
        """
        keys = check_keys(keys, distinct=True)
        if len(blobs) != len(keys):
            raise InvalidKeyError(f"expected one blob per key, got {len(blobs)} for {len(keys)}")
        views = [memoryview(b).cast("B") for b in blobs]
        too_big = [v.nbytes for v in views if v.nbytes > self.slot_bytes]
        if too_big:
            raise InvalidArgumentError(f"blob of {too_big[0]} B > slot_bytes {self.slot_bytes}")
        self._check_open()
        start = time.perf_counter()
        stored = np.zeros(len(keys), dtype=bool)
        new: list[tuple[int, bytes, memoryview]] = []  # (position, key, view)
        for i, key in enumerate(keys):
            if key in self._index:
                self._index.move_to_end(key)
                stored[i] = True
            elif key in self._pending:
                stored[i] = True
            else:
                new.append((i, key, views[i]))
        slots = self._reserve(len(new))
        if len(slots) < len(new):
            self._counters.num_full += len(new) - len(slots)
            new = new[: len(slots)]
        writes = [
            (slot, key, view, blob_length(view) or view.nbytes)
            for slot, (_i, key, view) in zip(slots, new)
        ]
        self._pending.update(w[1] for w in writes)
        task = asyncio.ensure_future(self._write_and_commit(writes))
        self._track(task)
        try:
            await with_deadline(asyncio.shield(task), self._deadline_s, "disk put_many")
        except TierTimeoutError as exc:
            self._counters.num_timeouts += 1
            self._counters.last_error = str(exc)
            raise
        finally:
            self._counters.add_put_time(time.perf_counter() - start)
        stored[[i for i, _k, _v in new]] = True
        num_bytes = sum(w[3] for w in writes)
        return PutResult(stored, int(stored.sum()), num_bytes, time.perf_counter() - start)

    async def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Read and verify the blobs; see ``TierBackend.get_many``."""
        keys = check_keys(keys)
        self._check_open()
        start = time.perf_counter()
        reads: list[tuple[int, int, int, bytes]] = []  # (slot, length, position, key)
        for pos, key in enumerate(keys):
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
                self._pins[entry[0]] = self._pins.get(entry[0], 0) + 1
                reads.append((entry[0], entry[1], pos, key))
        task = asyncio.ensure_future(self._read_and_release(reads))
        self._track(task)
        out: list[Buffer | None] = [None] * len(keys)
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
        self._counters.num_corrupt += sum(b is None for b in results) - num_failed
        for (_slot, length, pos, _key), blob in zip(reads, results):
            if blob is None:
                continue
            else:
                out[pos] = blob
                self._counters.bytes_read += length
        num_hits = sum(b is not None for b in out)
        self._counters.num_hits += num_hits
        self._counters.num_misses += len(keys) - num_hits
        return out

    async def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """bool ``[n]`` from the in-memory index (no I/O)."""
        keys = check_keys(keys)
        return np.fromiter((k in self._index for k in keys), dtype=bool, count=len(keys))

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Drop the keys from the index and free their slots (after in-flight reads)."""
        num = 0
        for key in check_keys(keys):
            entry = self._index.pop(key, None)
            if entry is not None:
                num += 1
                self._release(entry[0])
        return num

    async def aclose(self) -> None:
        """Wait for in-flight I/O, save the index (``persist_index``), close files and threads."""
        if self._closed:
            return
        self._closed = True
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._persist:
            self._save_index()
        self._pool.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)

    def statistics(self) -> TierStatistics:
        """Totals since construction (``io_mode`` ``"direct"`` or ``"buffered"``)."""
        return self._counters.snapshot()

    # ---- slots ----------------------------------------------------------------------------

    def _reserve(self, n: int) -> list[int]:
        """Up to ``n`` slots: free ones first, then LRU victims that no read pins."""
        if n > len(self._free):
            victims = [k for k, (s, _l) in self._index.items() if s not in self._pins]
            for key in victims[: n - len(self._free)]:
                slot, _length = self._index.pop(key)
                self._free.append(slot)
                self._counters.num_evicted += 1
        take = min(n, len(self._free))
        return [self._free.pop() for _ in range(take)]

    def _release(self, slot: int) -> None:
        if slot in self._pins:
            self._doomed.add(slot)
        else:
            self._free.append(slot)

    def _unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._free.append(slot)

    # ---- I/O ------------------------------------------------------------------------------

    def _locate(self, slot: int) -> tuple[int, int]:
        return slot % len(self._fds), (slot // len(self._fds)) * self.slot_bytes

    def _runs(self, slots: list[int]) -> list[list[int]]:
        """Indices into ``slots`` grouped into runs of consecutive slots of one file."""
        order = sorted(range(len(slots)), key=lambda i: self._locate(slots[i]))
        runs: list[list[int]] = []
        for i in order:
            f, off = self._locate(slots[i])
            if runs and len(runs[-1]) < self._max_run_slots:
                pf, poff = self._locate(slots[runs[-1][-1]])
                if pf == f and poff + self.slot_bytes == off:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        return runs

    async def _write_and_commit(self, writes: list[tuple[int, bytes, memoryview, int]]) -> None:
        """Write ``(slot, key, view, blob bytes)`` entries; then index them, or free the slots."""
        loop = asyncio.get_running_loop()
        slots = [w[0] for w in writes]
        jobs = []
        for run in self._runs(slots):
            fd, offset = self._locate(slots[run[0]])
            views = [writes[i][2] for i in run]
            jobs.append(
                loop.run_in_executor(self._pool, self._pwrite_run, self._fds[fd], offset, views)
            )
        results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for slot, key, _view, length in writes:
            self._pending.discard(key)
            if errors:
                self._free.append(slot)
            else:
                self._index[key] = (slot, length)
        if errors:
            exc = errors[0]
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            self._counters.num_full += len(writes) if full else 0
            self._counters.num_errors += 0 if full else 1
            message = f"disk write failed: {getattr(exc, 'strerror', None) or exc!r}"
            self._counters.last_error = message
            raise (TierFullError if full else TierError)(message)
        self._counters.num_stored += len(writes)
        self._counters.bytes_written += sum(w[3] for w in writes)

    def _pwrite_run(self, fd: int, offset: int, views: list[memoryview]) -> None:
        buf = None
        if self.is_direct and all(self._is_aligned_slot(v) for v in views):
            buffers: list[Buffer] = list(views)  # vectored, straight from the caller's rows
        elif self.is_direct:
            buf = self._staging(len(views) * self.slot_bytes)
            for i, view in enumerate(views):
                buf[i * self.slot_bytes : i * self.slot_bytes + view.nbytes] = view
            buffers = [memoryview(buf)[: len(views) * self.slot_bytes]]
        else:
            pad = memoryview(bytes(self.slot_bytes))
            buffers = []
            for i, view in enumerate(views):
                buffers.append(view)
                if i + 1 < len(views) and view.nbytes < self.slot_bytes:
                    buffers.append(pad[: self.slot_bytes - view.nbytes])
        expected = sum(memoryview(b).nbytes for b in buffers)
        written = os.pwritev(fd, buffers, offset)
        if buf is not None:
            buffers.clear()
            self._spare_buffers.append(buf)
        if written != expected:
            raise OSError(errno.EIO, f"short write {written} of {expected} B")

    def _is_aligned_slot(self, view: memoryview) -> bool:
        return (
            view.nbytes == self.slot_bytes
            and np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN_BYTES == 0
        )

    def _staging(self, num_bytes: int) -> mmap.mmap:
        """A page-aligned buffer of >= ``num_bytes`` (a spare one when one is big enough)."""
        try:
            buf = self._spare_buffers.pop()
        except IndexError:
            buf = None
        if buf is None or len(buf) < num_bytes:
            buf = mmap.mmap(-1, self._max_run_slots * self.slot_bytes)
        return buf

    async def _read_and_release(
        self, reads: list[tuple[int, int, int, bytes]]
    ) -> tuple[list[memoryview | None], int]:
        """Verified blob (or ``None``) per read, and how many reads failed with an I/O error."""
        loop = asyncio.get_running_loop()
        out: list[memoryview | None] = [None] * len(reads)
        num_failed = 0
        try:
            slots = [r[0] for r in reads]
            runs = self._runs(slots)
            jobs = []
            for run in runs:
                fd, offset = self._locate(slots[run[0]])
                items = [(reads[i][1], reads[i][3]) for i in run]
                jobs.append(
                    loop.run_in_executor(self._pool, self._pread_run, self._fds[fd], offset, items)
                )
            results = await asyncio.gather(*jobs, return_exceptions=True)
            for run, result in zip(runs, results):
                if isinstance(result, BaseException):
                    num_failed += len(run)
                    self._counters.num_errors += 1
                    self._counters.last_error = f"disk read failed: {result!r}"
                    continue
                for i, blob in zip(run, result):
                    out[i] = blob
        finally:
            for slot in (r[0] for r in reads):
                self._unpin(slot)
        return out, num_failed

    def _pread_run(
        self, fd: int, offset: int, items: list[tuple[int, bytes]]
    ) -> list[memoryview | None]:
        populate = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at once, not one by one
        buf = mmap.mmap(
            -1, len(items) * self.slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
        )
        got = os.preadv(fd, [buf], offset)
        whole = memoryview(buf)
        out: list[memoryview | None] = []
        for i, (length, key) in enumerate(items):
            lo = i * self.slot_bytes
            blob = whole[lo : lo + length] if lo + length <= got else None
            out.append(blob if blob is not None and verify(key, blob) is not None else None)
        return out

    # ---- files and the saved index ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError("disk tier is closed")

    def _track(self, task: asyncio.Task[object]) -> None:
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieve, no warning

    def _reopen_buffered(self) -> None:
        for i, fd in enumerate(self._fds):
            os.close(fd)
            self._fds[i] = os.open(self._paths[i], os.O_RDWR)

    def _index_path(self) -> Path:
        return Path(f"{self._paths[0]}.index")

    def _geometry(self) -> list[int]:
        return [_INDEX_VERSION, self.slot_bytes, self.num_slots, len(self._fds)]

    def _save_index(self) -> None:
        entries = [[k.hex(), s, n] for k, (s, n) in self._index.items()]
        tmp = self._index_path().with_suffix(".tmp")
        tmp.write_text(json.dumps({"geometry": self._geometry(), "entries": entries}))
        os.replace(tmp, self._index_path())

    def _load_index(self) -> None:
        path = self._index_path()
        try:
            saved = json.loads(path.read_text())
            path.unlink()
        except (OSError, ValueError):
            return
        if saved.get("geometry") != self._geometry():
            return
        used = set()
        for key_hex, slot, length in saved["entries"]:
            if 0 <= slot < self.num_slots and slot not in used and 0 < length <= self.slot_bytes:
                self._index[bytes.fromhex(key_hex)] = (slot, length)
                used.add(slot)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]


def _open(path: Path, size: int, direct: bool) -> tuple[int, bool]:
    """Open (creating) and preallocate ``path``; returns the fd and whether it is O_DIRECT."""
    flags = os.O_RDWR | os.O_CREAT
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError:
            fd = -1
    is_direct = fd >= 0
    if fd < 0:
        fd = os.open(path, flags, 0o600)
    if os.fstat(fd).st_size < size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, size)
    if is_direct:
        probe = mmap.mmap(-1, ALIGN_BYTES)
        try:
            os.preadv(fd, [probe], 0)
        except OSError:
            os.close(fd)
            return os.open(path, flags, 0o600), False
    return fd, is_direct
