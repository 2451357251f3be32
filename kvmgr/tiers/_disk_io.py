"""The disk tier's file work, with OS errors turned into tier errors: opening its slot files,
running its writes and reads in its thread pool, saving its index.

Private to ``kvmgr.tiers``: ``DiskTier`` (``disk.py``) is the tier; this module does what it
asks of the files, counting into its ``TierCounters``.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import numpy as np

from kvmgr.errors import TierError, TierFullError, TierUnavailableError
from kvmgr.tiers._disk_index import save_index
from kvmgr.tiers._disk_slots import SlotTable
from kvmgr.tiers._slot_files import FileInUseError, SlotFiles
from kvmgr.tiers.base import TierCounters
from kvmgr.tiers.blob import blob_length

__all__ = [
    "DiskIO",
    "fold_reads",
    "open_slot_files",
    "plan_writes",
    "read_and_release",
    "save_index_or_error",
    "write_and_commit",
]

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

#: ``(slot, key, view, blob bytes)`` of one blob to write
Write = tuple[int, bytes, memoryview, int]
#: ``(slot, length, position in the call, key)`` of one blob to read
Read = tuple[int, int, int, bytes]


@attrs.define(frozen=True)
class DiskIO:
    """What the I/O of one disk tier works on: its files, threads, slot table and counters."""

    files: SlotFiles
    pool: ThreadPoolExecutor
    slots: SlotTable
    counters: TierCounters


def open_slot_files(paths: list[Path], slot_bytes: int, num_slots: int, direct: bool) -> SlotFiles:
    """Create (or reopen), preallocate and lock the tier's files.

    Raises:
        TierUnavailableError: another open ``DiskTier`` holds them, or they cannot be created.
        TierFullError: the filesystem has no room to preallocate them.
    """
    where = f"disk tier {os.fspath(paths[0])}"
    try:
        return SlotFiles(paths, slot_bytes, num_slots, direct)
    except FileInUseError:
        raise TierUnavailableError(
            f"{where}: in use by another open DiskTier (its files are locked; one tier per "
            "file, one process per tier)"
        ) from None
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            size_gb = slot_bytes * num_slots / 1e9
            raise TierFullError(f"{where}: no room to preallocate {size_gb:.3g} GB") from None
        raise TierUnavailableError(f"{where}: {exc.strerror}") from None


def save_index_or_error(
    path: Path, geometry: list[int], index: OrderedDict[bytes, tuple[int, int]]
) -> TierError | None:
    """Save the index to ``path``; the error to raise when that failed (``None``: saved)."""
    try:
        save_index(path, geometry, index)
    except OSError as exc:
        where = f"disk tier {os.fspath(path).removesuffix('.index')}: index not saved"
        if exc.errno in _NO_ROOM:
            return TierFullError(f"{where}: the disk is full")
        return TierError(f"{where}: {exc.strerror or exc}")
    return None


def plan_writes(
    io: DiskIO, keys: list[bytes], views: list[memoryview], stored: np.ndarray
) -> tuple[list[Write], list[int]]:
    """Reserve slots for the blobs whose keys are not stored yet (evicting LRU entries).

    Returns:
        A ``Write`` per blob to write, and those blobs' positions in the call; ``stored[i]`` is
        set where the key is there already. Blobs that find no slot (every slot pinned by
        reads) are counted in ``num_full`` and not written.
    """
    new: list[tuple[int, bytes, memoryview]] = []  # (position, key, view)
    for i, key in enumerate(keys):
        if io.slots.is_stored(key):
            stored[i] = True
        else:
            new.append((i, key, views[i]))
    slots, num_evicted = io.slots.reserve(len(new))
    io.counters.num_evicted += num_evicted
    if len(slots) < len(new):
        io.counters.num_full += len(new) - len(slots)
        new = new[: len(slots)]
    writes = [
        (slot, key, view, blob_length(view) or view.nbytes)
        for slot, (_i, key, view) in zip(slots, new)
    ]
    return writes, [i for i, _k, _v in new]


async def write_and_commit(
    io: DiskIO, writes: list[Write], write_run: Callable[[int, int, list[memoryview]], None]
) -> None:
    """Write the blobs, one ``write_run(file, offset, views)`` per run of consecutive slots in
    the pool; then enter them into the index, or free their slots when a run failed.

    Raises:
        TierFullError: the disk filled up during a write.
        TierError: a write failed otherwise.
    """
    loop = asyncio.get_running_loop()
    slots = [w[0] for w in writes]
    jobs = []
    for run in io.files.runs(slots):
        file, offset = io.files.locate(slots[run[0]])
        views = [writes[i][2] for i in run]
        jobs.append(loop.run_in_executor(io.pool, write_run, file, offset, views))
    results = await asyncio.gather(*jobs, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    io.slots.commit([(slot, key, length) for slot, key, _view, length in writes], not errors)
    counters = io.counters
    if errors:
        exc = errors[0]
        full = isinstance(exc, OSError) and exc.errno in _NO_ROOM
        counters.num_full += len(writes) if full else 0
        counters.num_errors += 0 if full else 1
        message = f"disk write failed: {getattr(exc, 'strerror', None) or exc!r}"
        counters.last_error = message
        raise (TierFullError if full else TierError)(message)
    counters.num_stored += len(writes)
    counters.bytes_written += sum(w[3] for w in writes)


async def read_and_release(io: DiskIO, reads: list[Read]) -> tuple[list[memoryview | None], int]:
    """Read the pinned slots in the pool (one ``pread_run`` per run), then unpin them.

    Returns:
        The blob read per entry (structure checked; ``None``: unreadable), and how many
        entries failed with an I/O error (counted in ``num_errors``, per run).
    """
    loop = asyncio.get_running_loop()
    out: list[memoryview | None] = [None] * len(reads)
    num_failed = 0
    slots = [r[0] for r in reads]
    try:
        runs = io.files.runs(slots)
        jobs = []
        for run in runs:
            file, offset = io.files.locate(slots[run[0]])
            items = [(reads[i][1], reads[i][3]) for i in run]
            jobs.append(loop.run_in_executor(io.pool, io.files.pread_run, file, offset, items))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for run, result in zip(runs, results):
            if isinstance(result, BaseException):
                num_failed += len(run)
                io.counters.num_errors += 1
                io.counters.last_error = f"disk read failed: {result!r}"
                continue
            for i, blob in zip(run, result):
                out[i] = blob
    finally:
        for slot in slots:
            io.slots.unpin(slot)
    return out, num_failed


def fold_reads(
    io: DiskIO,
    num_keys: int,
    reads: list[Read],
    results: list[memoryview | None],
    num_failed: int,
) -> list[memoryview | None]:
    """The blob per key of a ``get_many`` of ``num_keys`` keys (``None``: a miss), counting
    hits, misses, bytes read and the blobs that read as corrupt."""
    counters = io.counters
    counters.num_corrupt += sum(b is None for b in results) - num_failed
    out: list[memoryview | None] = [None] * num_keys
    for (_slot, length, pos, _key), blob in zip(reads, results):
        if blob is not None:
            out[pos] = blob
            counters.bytes_read += length
    num_hits = sum(b is not None for b in out)
    counters.num_hits += num_hits
    counters.num_misses += num_keys - num_hits
    return out
