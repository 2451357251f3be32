"""The disk tier's files: fixed-size slots, positional vectored I/O, the saved index.

Offers (to ``kvmgr.tiers.disk`` only):
    ALIGN_BYTES     slot size unit and direct-I/O alignment (4 KiB)
    MAX_RUN_BYTES   one ``pwritev``/``preadv`` covers at most this many bytes
    SlotFiles       preallocated files of slots; runs of consecutive slots; blocking I/O calls
                    meant for worker threads
    save_index, load_index   the ``PATH.index`` file written on a clean close

Slot ``s`` lives in file ``s % num_files`` at offset ``(s // num_files) * slot_bytes``.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kvmgr.tiers.base import Buffer
from kvmgr.tiers.blob import blob_length

__all__ = ["ALIGN_BYTES", "MAX_RUN_BYTES", "SlotFiles", "load_index", "save_index"]

ALIGN_BYTES = 4096
#: several runs go to the worker threads at once, so one run's copy overlaps another's transfer
MAX_RUN_BYTES = 4 << 20
_INDEX_VERSION = 1


class SlotFiles:
    """Preallocated files of ``slot_bytes`` slots, opened ``O_DIRECT`` where the filesystem allows.

    Raises:
        OSError: a file cannot be created or preallocated (the caller maps it to a tier error).
    """

    def __init__(self, paths: list[Path], slot_bytes: int, num_slots: int, direct: bool) -> None:
        self.paths = paths
        self.slot_bytes = slot_bytes
        self.max_run_slots = max(1, MAX_RUN_BYTES // slot_bytes)
        size = -(-num_slots // len(paths)) * slot_bytes
        self.fds: list[int] = []
        modes: list[bool] = []
        try:
            for path in paths:
                fd, is_direct = _open(path, size, direct)
                self.fds.append(fd)
                modes.append(is_direct)
        except OSError:
            self.close()
            raise
        self.is_direct = all(modes)
        if any(modes) and not self.is_direct:  # one mode for all files
            for i, fd in enumerate(self.fds):
                os.close(fd)
                self.fds[i] = os.open(paths[i], os.O_RDWR)
        self._spare_buffers: list[mmap.mmap] = []  # aligned write staging, reused

    def close(self) -> None:
        """Close every file; idempotent."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []

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
            OSError: the write failed or was short.
        """
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
        expected = sum(memoryview(b).nbytes for b in buffers)
        written = os.pwritev(self.fds[file], buffers, offset)
        if buf is not None:
            buffers.clear()
            self._spare_buffers.append(buf)
        if written != expected:
            raise OSError(errno.EIO, f"short write {written} of {expected} B")

    def pread_run(
        self, file: int, offset: int, items: list[tuple[int, bytes]]
    ) -> list[memoryview | None]:
        """Read consecutive slots from ``offset``; ``items`` = (blob bytes, stored key) each.

        Returns each blob (a view of a fresh buffer; the caller verifies it) or ``None`` (a
        short read, or a header that does not claim exactly ``blob bytes``).

        Raises:
            OSError: the read failed.
        """
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


def save_index(path: Path, geometry: list[int], index: OrderedDict[bytes, tuple[int, int]]) -> None:
    """Write ``index`` (LRU order kept) and the tier geometry to ``path`` atomically."""
    entries = [[k.hex(), s, n] for k, (s, n) in index.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"geometry": [_INDEX_VERSION, *geometry], "entries": entries}))
    os.replace(tmp, path)


def load_index(
    path: Path, geometry: list[int], num_slots: int, slot_bytes: int
) -> OrderedDict[bytes, tuple[int, int]] | None:
    """The index saved at ``path`` for the same geometry (the file is removed), else ``None``."""
    try:
        saved = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        return None
    if saved.get("geometry") != [_INDEX_VERSION, *geometry]:
        return None
    index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
    used = set()
    for key_hex, slot, length in saved["entries"]:
        if 0 <= slot < num_slots and slot not in used and 0 < length <= slot_bytes:
            index[bytes.fromhex(key_hex)] = (slot, length)
            used.add(slot)
    return index


def _open(path: Path, size: int, direct: bool) -> tuple[int, bool]:
    """Open (creating) and preallocate ``path``; returns the fd and whether it is O_DIRECT."""
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
