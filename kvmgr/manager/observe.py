"""Waiting and observability calls of ``OffloadManager``: ``wait``, statistics, snapshots,
KV events, stream waits.

Private to ``kvmgr.manager``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvmgr.errors import (
    InvalidArgumentError,
    TransferTimeoutError,
)
from kvmgr.manager.core import ManagerCore, check_timeout
from kvmgr.manager.snapshot import ManagerSnapshot, take_snapshot
from kvmgr.reports import (
    KVEvent,
    ManagerStatistics,
)
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.jobs import Direction

__all__ = ["Observing"]


class Observing(ManagerCore):
    """Waiting, statistics, snapshots and events (mixed into ``OffloadManager``)."""

    # ------------------------------------------------------------------ waiting

    async def wait(self, future: asyncio.Future[Any], timeout_s: float | None = None) -> Any:
        """Await a swap's future with a deadline.

        On timeout the copy is NOT cancelled: its blocks stay fenced (PENDING keys, pinned
        readers, a moving block table) until the copy truly ends and its bookkeeping runs.
        Cancelling the awaiting task likewise leaves the copy and the bookkeeping intact.

        Raises:
            InvalidArgumentError: ``future`` is not an asyncio future, or a bad ``timeout_s``.
            TransferTimeoutError: ``timeout_s`` seconds passed first (counted in
                ``ManagerStatistics.await_timeouts``).
            TransferError: whatever the swap raises (``TransferError``, ``ClosedError``, ...).
        """
        if not asyncio.isfuture(future):
            raise InvalidArgumentError(
                f"expected the future of a swap, got {type(future).__name__}: {future!r}"
            )
        timeout_s = check_timeout(timeout_s)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            self._books.counters.await_timeouts += 1
            raise TransferTimeoutError(
                f"swap not complete after {timeout_s} s; its blocks stay fenced until it ends"
            ) from None

    # ------------------------------------------------------------------ observability

    def statistics(self) -> ManagerStatistics:
        """A snapshot of totals and gauges (see ``ManagerStatistics``)."""
        self._settle_deferred()
        books = self._books
        c, cpu = books.counters, books.cpu
        gpu_pool = books.gpu.pool
        cpu_pool = self.cpu_pool
        memory = None if cpu_pool is None else cpu_pool.memory
        return ManagerStatistics(
            **{name: getattr(c, name) for name in Counters.TOTALS},
            rejected=dict(c.rejected),
            events_dropped=books.events.num_dropped,
            batch_blocks=c.batch_blocks.freeze(),
            completion_s=c.completion_s.freeze(),
            batches_in_flight=len(self._queue.in_flight),
            queued_swaps=len(self._queue),
            stores_waiting=len(self._room),
            cpu_blocks_used=cpu.pool.num_allocated,
            cpu_blocks_total=cpu.num_blocks,
            cpu_blocks_ready=cpu.num_blocks if cpu_pool is None else cpu_pool.num_blocks_ready,
            cpu_pinning=None if memory is None else memory.statistics(),
            cpu_keys_pending=cpu.num_pending,
            cpu_keys_ready=len(cpu.index) - cpu.num_pending,
            cpu_keys_loading=cpu.num_loading,
            gpu_blocks_free=None if gpu_pool is None else gpu_pool.num_free,
            policy=cpu.policy.name,
            engine=f"ranks x{self._transport.num_ranks}"
            if self._worker is None
            else self.engine.name,
        )

    def snapshot(self) -> ManagerSnapshot:
        """Every block, key, table and queued or in-flight swap, as frozen values (for tests
        and ``kvmgr.testing.check_invariants``; costs O(blocks), not for the hot path)."""
        self._settle_deferred()
        promoting = () if self._tiers is None else tuple(self._tiers.promoting)
        return take_snapshot(
            self._books,
            self._queue,
            promoting,
            self._room.stores,
            self._transport.engine_batches,
        )

    def take_events(self) -> list[KVEvent]:
        """Remove and return the KV events recorded since the last call, oldest first: a
        ``removed`` event of the keys a store evicted comes before that store's ``stored``."""
        self._settle_deferred()
        return self._books.events.take()

    def events(self) -> AsyncIterator[KVEvent]:
        """An async iterator over KV events as they happen (``async for ev in mgr.events()``);
        it drains the same stream as ``take_events`` and ends when the manager closes."""
        return self._books.events.iterate()

    def stream_wait_loads(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait on the device for every load
        in flight, without blocking the host (docs/transfer.md, rule 4). No-op on the host
        engine.

        Raises:
            InvalidArgumentError: ``stream`` is neither None nor a stream (an object with
                ``wait_event``, such as ``torch.cuda.Stream``); checked on every engine.
        """
        if stream is not None and not callable(getattr(stream, "wait_event", None)):
            raise InvalidArgumentError(
                f"stream must be None or a CUDA stream (torch.cuda.Stream), got {stream!r}"
            )
        for batch in self._queue.in_flight.values():
            if batch.direction is Direction.H2D:
                self._transport.stream_wait(batch.seq, stream)
