"""The protocol every lower tier implements, its statistics, and the deadline helper.

Offers:
    TierBackend      the async protocol (put_many, get_many, contains_many, delete_many, aclose,
                     statistics) a disk tier, a Valkey/Redis tier, or later a Mooncake store or
                     an LMCache server implements
    PutResult        what a batched write stored
    TierStatistics   frozen counters of one backend (totals since construction)
    TierCounters     the mutable counters a backend keeps and snapshots
    check_keys       the block-key rule (``kvmgr._keys``), re-exported for the backends
    blob_views       the blobs of a ``put_many`` as byte views, one per key, checked
    with_deadline    run one awaitable under a deadline, raising ``TierTimeoutError``
    join_worker      await a worker thread; a cancellation waits for the worker to end first

Semantics shared by all backends:
    - Keys are the *stored* keys (``TierNamespace.stored_keys``), ``bytes``; values are blobs made
      by ``kvmgr.tiers.blob`` (header + pages + checksum + MAC). A backend returns what it
      stored (``None`` where absent); ``TierBridge`` verifies every blob against its namespace
      (``blob.verify``: checksum, layout, the tenant's MAC) before any byte reaches a CPU
      block that is served. Only the bridge knows the namespace's keys.
    - Every operation has a deadline. A slow or dead backend raises a ``TierError`` subclass
      (``TierTimeoutError``, ``TierUnavailableError``, ``TierFullError``) and counts it; it never
      hangs. Callers (``TierBridge``) turn errors into misses.
    - A backend may drop any key at any time (eviction): a later get is a miss.
    - Optional hints a backend may define (``TierBridge`` reads them with ``getattr``):
      ``blob_alignment`` (int bytes: hand blobs padded to this size at aligned addresses, for
      direct I/O without a copy; the header's length says where the blob ends) and
      ``chunk_bytes`` (int: take a batch in chunks of about this many bytes, so gather/scatter
      overlaps the I/O; only for backends where a call is not a network round trip).
    - Optional zero-copy read (``SharedTier`` has it; ``TierBridge`` uses it when present):
      ``get_into(keys, vectors, check)`` receives blob ``i`` into the buffers ``vectors[i]`` (a
      header row and the block's pages) and returns bool hits, ``check(i)`` judging each landed
      blob; it writes the buffers until its await ends, and not after (``join_worker``).
      Writes always arrive through ``put_many`` as staged rows (``TierBridge.stage``: the one
      write path, the manager's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import attrs
import numpy as np

from kvmgr._keys import check_keys
from kvmgr.errors import InvalidArgumentError, InvalidKeyError, TierTimeoutError

__all__ = [
    "Buffer",
    "PutResult",
    "TierBackend",
    "TierCounters",
    "TierStatistics",
    "blob_views",
    "check_keys",
    "join_worker",
    "with_deadline",
]

T = TypeVar("T")

#: A blob: anything with the buffer protocol that ``memoryview`` accepts (bytes, memoryview,
#: a contiguous numpy uint8 row).
Buffer = bytes | bytearray | memoryview


@attrs.frozen
class PutResult:
    """What one ``put_many`` stored.

    Attributes:
        stored: bool ``[n]``: ``True`` where the key is now readable (written, or already there).
        num_stored: ``stored.sum()``.
        num_bytes: blob bytes written by this call (keys already present count 0).
        seconds: wall time of the call.
    """

    stored: np.ndarray
    num_stored: int
    num_bytes: int
    seconds: float


@attrs.define
class _TierTotals:
    """The counter fields of one backend, declared once: ``TierStatistics`` freezes them,
    ``TierCounters`` updates them."""

    name: str
    io_mode: str
    num_put_batches: int = 0
    num_get_batches: int = 0
    num_stored: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_corrupt: int = 0
    num_timeouts: int = 0
    num_errors: int = 0
    num_full: int = 0
    num_evicted: int = 0
    num_already_present: int = 0
    num_fail_fast: int = 0
    num_redirects: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    put_s: float = 0.0
    get_s: float = 0.0
    max_put_s: float = 0.0
    max_get_s: float = 0.0
    last_error: str | None = None


@attrs.frozen
class TierStatistics(_TierTotals):
    """Counters of one backend, totals since construction (blocks, bytes, seconds).

    Attributes:
        name: backend kind (``"disk"``, ``"shared"``).
        io_mode: how it does I/O (``"direct"``/``"buffered"`` for disk, ``"resp"`` for one
            Valkey/Redis server, ``"cluster"`` for a cluster).
        num_put_batches / num_get_batches: calls of ``put_many`` / ``get_many``.
        num_stored: blobs written.
        num_hits: blobs returned, verified.
        num_misses: keys asked for and not returned (absent, evicted, corrupt, or failed call).
        num_corrupt: values found but rejected: a length that is not the expected blob's, or
            (zero-copy reads) the bridge's check failed in the worker; part of ``num_misses``.
            Every checksum or MAC failure is also in ``BridgeStatistics.num_corrupt``.
        num_timeouts: calls that passed their deadline.
        num_errors: calls that failed otherwise (connection, authentication, I/O).
        num_full: writes refused for lack of space.
        num_evicted: blobs the backend itself dropped to make room (disk LRU; the shared
            server's own evictions are not visible here).
        num_already_present: blobs not written because the backend held the key already.
        num_fail_fast: calls (or a cluster call's per-node parts) refused without touching the
            network because the server's breaker was open (also counted in ``num_errors``).
        num_redirects: cluster ``MOVED``/``ASK`` redirections followed.
        bytes_written / bytes_read: blob bytes moved.
        put_s / get_s: total seconds inside ``put_many`` / ``get_many``.
        max_put_s / max_get_s: the slowest single call.
        last_error: the last error's message (never contains credentials), or ``None``.
    """


@attrs.define
class TierCounters(_TierTotals):
    """The mutable twin of ``TierStatistics`` that a backend updates; ``snapshot()`` freezes it."""

    def add_put_time(self, seconds: float) -> None:
        """Count one ``put_many`` call of ``seconds``."""
        self.num_put_batches += 1
        self.put_s += seconds
        self.max_put_s = max(self.max_put_s, seconds)

    def add_get_time(self, seconds: float) -> None:
        """Count one ``get_many`` call of ``seconds``."""
        self.num_get_batches += 1
        self.get_s += seconds
        self.max_get_s = max(self.max_get_s, seconds)

    def snapshot(self) -> TierStatistics:
        """A frozen copy of the counters."""
        return TierStatistics(**attrs.asdict(self))


@runtime_checkable
class TierBackend(Protocol):
    """A lower tier: batched, async, every call under a deadline, typed errors.

    Implementations: ``DiskTier`` (local file of fixed-size slots), ``SharedTier`` (Valkey/Redis).
    """

    name: str

    async def put_many(self, keys: Sequence[bytes], blobs: Sequence[Buffer]) -> PutResult:
        """Store ``blobs[i]`` under ``keys[i]`` (keys distinct); one round trip per batch.

        Raises:
            InvalidKeyError: keys not bytes, repeated, or ``len(keys) != len(blobs)``.
            InvalidArgumentError: a blob is not a C-contiguous buffer (``blob_views``).
            TierTimeoutError, TierUnavailableError, TierFullError, TierError: the write failed
                (some blobs may have landed; none is readable half-written).
        """
        ...

    async def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The stored blob of each key, ``None`` where absent (or malformed).

        Raises:
            InvalidKeyError: a key is not bytes.
            TierTimeoutError, TierUnavailableError, TierError: the read failed.
        """
        ...

    async def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """bool ``[n]``: whether each key is stored (not verified; a hint for lookups).

        Raises:
            InvalidKeyError, TierError: as ``get_many``.
        """
        ...

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove the keys; returns how many were present.

        Raises:
            InvalidKeyError, TierError: as ``get_many``.
        """
        ...

    async def aclose(self) -> None:
        """Release connections, files and threads; idempotent."""
        ...

    def statistics(self) -> TierStatistics:
        """Totals since construction."""
        ...


def blob_views(blobs: object, num_keys: int) -> list[memoryview]:
    """The blobs of a ``put_many`` of ``num_keys`` keys as flat byte views (no copy).

    Raises:
        InvalidKeyError: ``blobs`` is not a sequence of ``num_keys`` items.
        InvalidArgumentError: a blob is not a C-contiguous buffer (``bytes``, ``bytearray``,
            ``memoryview``, a contiguous numpy array).
    """
    if not hasattr(blobs, "__len__") or not hasattr(blobs, "__iter__"):
        raise InvalidKeyError(
            f"expected one blob per key, got {type(blobs).__name__} for {num_keys} keys"
        )
    if len(blobs) != num_keys:  # type: ignore[arg-type]
        raise InvalidKeyError(f"expected one blob per key, got {len(blobs)} for {num_keys}")  # type: ignore[arg-type]
    views = []
    for i, blob in enumerate(blobs):  # type: ignore[attr-defined]
        try:
            views.append(memoryview(blob).cast("B"))
        except TypeError as exc:  # no buffer, or a strided one
            raise InvalidArgumentError(
                f"blob {i}: expected a C-contiguous buffer, got {type(blob).__name__} ({exc})"
            ) from None
    return views


async def with_deadline(awaitable: Awaitable[T], deadline_s: float, what: str) -> T:
    """Await ``awaitable``; past ``deadline_s`` seconds cancel it and raise ``TierTimeoutError``.

    Raises:
        TierTimeoutError: the deadline passed (the awaitable was cancelled).
    """
    try:
        return await asyncio.wait_for(awaitable, deadline_s)
    except asyncio.TimeoutError:
        raise TierTimeoutError(f"{what} passed its {deadline_s:g} s deadline") from None


async def join_worker(future: asyncio.Future[T]) -> T:
    """Await a worker thread's ``future``; if the awaiting task is cancelled (once or more),
    keep waiting until the worker has ended, then raise the ``CancelledError``.

    For work that reads or writes memory the caller hands out again after the await: a
    cancellation must not settle before the worker let go (issue 26: a cancelled fetch freed CPU
    blocks its scatter thread still wrote, and the next store served those bytes). The delay a
    cancellation takes is what is left of the worker's own run (a copy of one batch).
    ``asyncio.wait`` never cancels the future it waits on, so the worker is never interrupted.

    Raises:
        asyncio.CancelledError: the awaiting task was cancelled (raised after the worker ended).
        Exception: whatever the worker raised, when the task was not cancelled.
    """
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not future.cancelled():
            future.exception()  # retrieved: the caller is gone, the cancellation wins
        raise cancelled
    return future.result()
