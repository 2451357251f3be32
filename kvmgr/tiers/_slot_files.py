"""The disk tier's files: fixed-size slots, positional vectored I/O, the saved index.

Offers (to ``kvmgr.tiers.disk`` only):
    ALIGN_BYTES     slot size unit and direct-I/O alignment (4 KiB)
    MAX_RUN_BYTES   one ``pwritev``/``preadv`` covers at most this many bytes
    SlotFiles       preallocated, locked files of slots; runs of consecutive slots; blocking I/O
                    calls meant for worker threads; closed only once no I/O call uses them
    FileInUseError  another tier (another process) holds the files' lock

Slot ``s`` lives in file ``s % num_files`` at offset ``(s // num_files) * slot_bytes``.

Preallocation is real or refused: ``posix_fallocate`` must succeed (a sparse file would fail
writes later, when the disk fills). The first file carries an exclusive ``flock`` for the tier's
lifetime, so two tiers (two processes) never share the files. A write that the kernel cuts short
is continued; a real error (``ENOSPC``) surfaces with its errno. ``close`` while an I/O call is
still in a worker thread (a stuck disk) defers closing the descriptors to the end of that call:
a descriptor number is never reused while a thread may still write through it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvmgr.tiers.base import Buffer
from kvmgr.tiers.blob import blob_length

__all__ = [
    "ALIGN_BYTES",
    "MAX_RUN_BYTES",
    "FileInUseError",
    "SlotFiles",
]


class FileInUseError(OSError):
    """The tier's first file is locked by another open tier."""


ALIGN_BYTES = 4096
#: several runs go to the worker threads at once, so one run's copy overlaps another's transfer
MAX_RUN_BYTES = 4 << 20


class SlotFiles:
    """Preallocated files of ``slot_bytes`` slots, opened ``O_DIRECT`` where the filesystem allows.

    Raises:
        FileInUseError: another tier holds the first file's lock.
        OSError: a file cannot be created or preallocated (the caller maps it to a tier error);
            files this call created are removed again.
    """

    def __init__(self, paths: list[Path], slot_bytes: int, num_slots: int, direct: bool) -> None:
        self.paths = paths
        self.slot_bytes = slot_bytes
        self.max_run_slots = max(1, MAX_RUN_BYTES // slot_bytes)
        size = -(-num_slots // len(paths)) * slot_bytes
        self.fds: list[int] = []
        self._lock = threading.Lock()
        self._busy = 0  # I/O calls in worker threads
        self._closing = False
        modes: list[bool] = []
        created = [not p.exists() for p in paths]
        self._lock_fd: int | None = None
        try:
            self._lock_fd = _lock(paths[0])  # first, before anything is resized
            for path in paths:
                fd, is_direct = _open(path, size, direct)
                self.fds.append(fd)
                modes.append(is_direct)
        except OSError as exc:
            if isinstance(exc, FileInUseError):
                created = [False] * len(paths)  # another tier's files: leave them
            self._close_now()
            for path, new in zip(paths, created):
                if new:
                    path.unlink(missing_ok=True)
            raise
        self.is_direct = all(modes)
        if any(modes) and not self.is_direct:  # one mode for all files
            for i, fd in enumerate(self.fds):
                os.close(fd)
                self.fds[i] = os.open(paths[i], os.O_RDWR)
        self._spare_buffers: list[mmap.mmap] = []  # aligned write staging, reused

    def close(self) -> bool:
        """Close every file (releasing the lock) now, or, if an I/O call is still running in a
        worker thread, when the last one ends. Returns whether they are closed now. Idempotent.
        """
        with self._lock:
            self._closing = True
            if self._busy:
                return False
        self._close_now()
        return True

    def _close_now(self) -> None:
        fds, self.fds = self.fds, []
        if self._lock_fd is not None:
            fds.append(self._lock_fd)
            self._lock_fd = None
        for fd in fds:
            os.close(fd)

    def _enter(self) -> None:
        with self._lock:
            if self._closing:
                raise OSError(errno.EBADF, "the disk tier's files are closed")
            self._busy += 1

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1
            last = self._closing and not self._busy
        if last:
            self._close_now()

    def locate(self, slot: int) -> tuple[int, int]:
        """(file index, byte offset) of ``slot``."""
        return slot % len(self.fds), (slot // len(self.fds)) * self.slot_bytes

    def runs(self, slots: list[int]) -> list[list[int]]:
        """Indices into ``slots`` grouped into runs of consecutive slots of one file."""
        order = sorted(range(len(slots)), key=lambda i: self.locate(slots[i]))
        runs: list[list[int]] = []
        for i in order:
            f, off = self.locate(slots[i])
            if runs and len(runs[-1]) < self.max_run_slots:
                pf, poff = self.locate(slots[runs[-1][-1]])
                if pf == f and poff + self.slot_bytes == off:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        return runs

    def pwrite_run(self, file: int, offset: int, views: list[memoryview]) -> None:
        """Write ``views`` to consecutive slots from ``offset`` (blocking; a worker thread).

        Direct I/O: slot-sized 4 KiB-aligned views go out as they are (one ``pwritev``), others
        through an aligned staging buffer. Buffered: the views, padded to slot boundaries.

        Raises:
            OSError: the write failed (``ENOSPC`` when the disk is full, even after a part of it
                was written: a short write is continued until the kernel says why it stops).
        """
        self._enter()
        try:
            self._pwrite_run(file, offset, views)
        finally:
            self._leave()

    def _pwrite_run(self, file: int, offset: int, views: list[memoryview]) -> None:
        buf = None
        if self.is_direct and all(self._is_aligned_slot(v) for v in views):
            buffers: list[Buffer] = list(views)
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
        try:
            _pwrite_all(self.fds[file], buffers, offset)
        finally:
            if buf is not None:
                buffers.clear()
                self._spare_buffers.append(buf)

    def pread_run(
        self, file: int, offset: int, items: list[tuple[int, bytes]]
    ) -> list[memoryview | None]:
        """Read consecutive slots from ``offset``; ``items`` = (blob bytes, stored key) each.

        Returns each blob (a view of a fresh buffer; the caller verifies it) or ``None`` (a
        short read, or a header that does not claim exactly ``blob bytes``).

        Raises:
            OSError: the read failed.
        """
        self._enter()
        try:
            return self._pread_run(file, offset, items)
        finally:
            self._leave()

    def _pread_run(
        self, file: int, offset: int, items: list[tuple[int, bytes]]
    ) -> list[memoryview | None]:
        populate = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at once
        buf = mmap.mmap(
            -1, len(items) * self.slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
        )
        got = os.preadv(self.fds[file], [buf], offset)
        whole = memoryview(buf)
        out: list[memoryview | None] = []
        for i, (length, _key) in enumerate(items):
            lo = i * self.slot_bytes
            blob = whole[lo : lo + length] if lo + length <= got else None
            out.append(blob if blob is not None and blob_length(blob) == length else None)
        return out

    def _is_aligned_slot(self, view: memoryview) -> bool:
        return (
            view.nbytes == self.slot_bytes
            and np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN_BYTES == 0
        )

    def _staging(self, num_bytes: int) -> mmap.mmap:
        """A page-aligned buffer of >= ``num_bytes`` (a spare one when one is big enough)."""
        try:  # (worker threads share the list: pop, never check-then-pop)
            buf: mmap.mmap | None = self._spare_buffers.pop()
        except IndexError:
            buf = None
        if buf is None or len(buf) < num_bytes:
            buf = mmap.mmap(-1, max(num_bytes, self.max_run_slots * self.slot_bytes))
        return buf


def _pwrite_all(fd: int, buffers: list[Any], offset: int) -> None:
    """``pwritev`` all of ``buffers`` at ``offset``, continuing after short writes."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.pwritev(fd, views, offset)
        if written == 0:
            raise OSError(errno.ENOSPC, "no progress writing to the disk tier")
        offset += written
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _lock(path: Path) -> int:
    """Open (creating) ``path`` and take its exclusive ``flock``; returns the descriptor.

    Raises:
        FileInUseError: another open tier holds the lock.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FileInUseError(errno.EBUSY, "locked by another open disk tier") from None
    return fd


def _open(path: Path, size: int, direct: bool) -> tuple[int, bool]:
    """Open (creating) and preallocate ``path``; returns the fd and whether it is O_DIRECT.

    Raises:
        OSError: open or ``posix_fallocate`` failed (never left sparse).
    """
    flags = os.O_RDWR | os.O_CREAT
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError:  # tmpfs and some overlay filesystems refuse O_DIRECT
            fd = -1
    is_direct = fd >= 0
    if fd < 0:
        fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # (also fills holes of an existing file)
    except OSError:
        os.close(fd)
        raise
    if is_direct:
        probe = mmap.mmap(-1, ALIGN_BYTES)
        try:
            os.preadv(fd, [probe], 0)
        except OSError:
            os.close(fd)
            return os.open(path, flags, 0o600), False
    return fd, is_direct
