"""The read path of a ``TierBridge``, and what both its paths share (private to
``kvmgr.tiers``; ``kvmgr.tiers.bridge`` documents the behaviour).

Offers:
    BridgeReads   ``read(stored_keys, ids)``: blobs from the backend, verified, into CPU blocks;
                  bool hits
    FailureLog    counts a bridge's tier errors, warns on the first of a run of failures
    retrieve      marks a left-behind task's exception retrieved
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import numpy as np

from kvmgr.errors import TierError
from kvmgr.tiers._bridge_records import BridgeCounters
from kvmgr.tiers._pages import CORRUPT, LAYOUT, OK, CpuPages
from kvmgr.tiers.base import TierBackend
from kvmgr.tiers.blob import HEADER_BYTES, TierNamespace

__all__ = ["BridgeReads", "FailureLog", "retrieve"]

_log = logging.getLogger("kvmgr.tiers.bridge")  # the bridge's log, whichever path writes it


@attrs.define(eq=False)
class FailureLog:
    """A bridge's tier errors: counted in ``counters.num_errors``; a warning on the first of a
    run of failures, debug messages for the rest of the run."""

    counters: BridgeCounters
    backend: TierBackend
    failing: bool = False  # the last call failed

    def failed(self, what: str, num_blocks: int, exc: TierError) -> None:
        """Count a tier error of a call of ``num_blocks`` blocks and log it."""
        self.counters.num_errors += 1
        level = logging.DEBUG if self.failing else logging.WARNING
        self.failing = True
        _log.log(level, "tier %s: %s of %d blocks failed: %s", self.backend.name, what, num_blocks, exc)  # fmt: skip

    def succeeded(self) -> None:
        """A call got through: the next failure warns again."""
        self.failing = False


@attrs.define(eq=False)
class BridgeReads:
    """How a bridge reads: with a backend that has ``get_into`` (zero copy), each blob is
    received into a header row and the block's pages and verified there by the backend's
    worker; otherwise every chunk's ``get_many`` starts at once and chunk k is verified and
    scattered (``maybe_thread``: in a worker thread for large batches) while later ones are
    read. Verdicts other than OK are counted; a tier error is a miss (``failures``)."""

    pages: CpuPages
    backend: TierBackend
    namespace: TierNamespace
    counters: BridgeCounters
    failures: FailureLog
    chunk_blocks: int
    maybe_thread: Callable[[int, Callable[[], None]], Awaitable[None]]
    #: zero-copy reads: blobs land in the pages themselves
    receives_into: bool = attrs.field(init=False)

    @receives_into.default
    def _has_get_into(self) -> bool:
        return callable(getattr(self.backend, "get_into", None))

    async def read(self, stored_keys: list[bytes], ids: np.ndarray) -> np.ndarray:
        """bool ``[n]``: ``True`` where CPU block ``ids[i]`` now holds ``stored_keys[i]``'s
        verified pages."""
        if self.receives_into:
            return await self._into(stored_keys, ids)
        return await self._copied(stored_keys, ids)

    async def _copied(self, stored_keys: list[bytes], ids: np.ndarray) -> np.ndarray:
        """Read blobs, then verify and scatter them (in a worker thread for large batches)."""
        hit = np.zeros(len(stored_keys), dtype=bool)
        # all chunks' reads start at once; chunk k is scattered while later ones are read
        gets = []
        for lo in range(0, len(stored_keys), self.chunk_blocks):
            part = slice(lo, lo + self.chunk_blocks)
            task = asyncio.ensure_future(self.backend.get_many(stored_keys[part]))
            task.add_done_callback(retrieve)
            gets.append((lo, task))
        for lo, task in gets:
            try:
                blobs = await task
            except TierError as exc:
                num = len(stored_keys[lo : lo + self.chunk_blocks])
                self.failures.failed("promote", num, exc)
                continue
            self.failures.succeeded()
            positions = [i for i, blob in enumerate(blobs, start=lo) if blob is not None]
            if not positions:
                continue
            verdict = np.zeros(len(positions), dtype=np.int8)
            scatter = functools.partial(
                self.pages.verify_scatter,
                [stored_keys[i] for i in positions],
                ids[positions],
                [blobs[i - lo] for i in positions],
                verdict,
            )
            await self.maybe_thread(len(positions), scatter)
            self._count_verdicts(verdict)
            hit[np.asarray(positions)[verdict == OK]] = True
        return hit

    async def _into(self, stored_keys: list[bytes], ids: np.ndarray) -> np.ndarray:
        """Zero-copy: each blob is received into a header row and the block's pages, and
        verified there by the backend's worker (``check``)."""
        headers = np.empty((len(ids), HEADER_BYTES), dtype=np.uint8)
        pages = [self.pages.pages(block) for block in ids.tolist()]
        vectors = [[headers[i], *pages[i]] for i in range(len(ids))]
        verdict = np.zeros(len(ids), dtype=np.int8)

        def check(i: int) -> bool:
            verdict[i] = self.pages.judge(stored_keys[i], headers[i], pages[i])
            return bool(verdict[i] == OK)

        get_into = self.backend.get_into  # type: ignore[attr-defined]
        try:
            hit = await get_into(stored_keys, vectors, check, self.namespace.blob_bytes)
        except TierError as exc:
            self.failures.failed("promote", len(ids), exc)
            return np.zeros(len(ids), dtype=bool)
        self.failures.succeeded()
        self._count_verdicts(verdict)
        return np.asarray(hit, dtype=bool) & (verdict == OK)

    def _count_verdicts(self, verdict: np.ndarray) -> None:
        self.counters.num_layout_mismatch += int(np.count_nonzero(verdict == LAYOUT))
        self.counters.num_corrupt += int(np.count_nonzero(verdict == CORRUPT))


def retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a task's exception retrieved (a cancelled demote/promote leaves tasks behind)."""
    if not task.cancelled():
        task.exception()
