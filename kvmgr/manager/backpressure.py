"""Backpressure for stores that find the CPU tier full: fail at once, or wait (bounded).

Private to ``kvmgr.manager``. With ``backpressure="wait"`` a store that cannot make room is
registered here with the future its caller got. While it waits it *holds its GPU blocks*
exactly like a queued store: one busy count on each block it names, so a ``free`` of their
request leaves them ``DRAINING`` and no ``allocate`` can hand them to another request before
the store has read them. Whenever room may have appeared (a copy completed, a request was
freed, keys were invalidated) ``wake`` retries every waiting store at once, on the loop thread,
and queues those that found room before anything else runs (so the next ``step()`` submits
them); after ``store_wait_s`` seconds a store still waiting fails with ``PoolExhaustedError``
(reason ``"timeout"``). Cancelling the future while it waits drops the store and its hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmgr.errors import PoolExhaustedError
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.scheduler.queue import Part

__all__ = ["RoomWaiters", "WaitingFuture", "WaitingStore"]


class WaitingFuture(asyncio.Future):  # type: ignore[type-arg]
    """The future of a store that waits for room: cancelling it drops the store and its hold
    at once (not one loop iteration later, as a done callback would)."""

    def __init__(self, *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.on_cancel: Callable[[], None] | None = None

    def cancel(self, msg: Any = None) -> bool:
        cancelled = super().cancel(msg)
        if cancelled and self.on_cancel is not None:
            self.on_cancel()
        return cancelled

    def set_exception(self, exception: Any) -> None:
        super().set_exception(exception)
        self.exception()  # mark retrieved: an unawaited failure is counted (as the flush's)


class WaitingStore:
    """A store waiting for room: its caller's future, how to retry it, the GPU blocks it holds.

    Attributes:
        future: the future its caller awaits (the queued part resolves the same future).
        attempt: ``attempt(future) -> Part``: the store's prepare, without re-validating the
            GPU blocks (they are held); raises ``PoolExhaustedError`` while there is no room.
        gpu_ids: int64 ``[n]``: every GPU block the store names, one busy count each.
        keys: the store's keys (for the snapshot).
        needed / available: the last shortfall seen (for the timeout's error).
    """

    __slots__ = ("attempt", "available", "future", "gpu_ids", "keys", "needed", "timer")

    def __init__(
        self,
        future: asyncio.Future[Any],
        attempt: Callable[[asyncio.Future[Any]], Part],
        gpu_ids: np.ndarray,
        keys: list[bytes],
        exc: PoolExhaustedError,
    ) -> None:
        self.future = future
        self.attempt = attempt
        self.gpu_ids = gpu_ids
        self.keys = keys
        self.needed, self.available = exc.needed, exc.available
        self.timer: asyncio.TimerHandle | None = None


class RoomWaiters:
    """Stores waiting for room, oldest first; each holds its GPU blocks until it settles.

    Args:
        gpu: the manager's GPU blocks (busy counts).
        counters: where timeouts are counted (``rejected["timeout"]``).
        enqueue: queues a prepared part (the facade's ``_enqueue``).
        settle: prepares the recorded per-call stores (``Bookkeeper.settle_deferred``): their
            parts, queued before any retry.
    """

    def __init__(
        self,
        gpu: GpuBlocks,
        counters: Counters,
        enqueue: Callable[[Part], None],
        settle: Callable[[], list[Part]] = list,
    ) -> None:
        self._gpu = gpu
        self._counters = counters
        self._enqueue = enqueue
        self._settle = settle
        self._waiting: list[WaitingStore] = []
        #: stores queued by ``wake`` since the flag was last cleared (``step`` reads it)
        self.num_requeued = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def stores(self) -> tuple[WaitingStore, ...]:
        """The waiting stores, oldest first (for the snapshot)."""
        return tuple(self._waiting)

    def wait(
        self,
        loop: asyncio.AbstractEventLoop,
        store: WaitingStore,
        timeout_s: float,
    ) -> None:
        """Register a store that found no room: hold its GPU blocks, arm its deadline."""
        self._gpu.acquire(store.gpu_ids)
        self._waiting.append(store)
        store.timer = loop.call_later(timeout_s, self._expire, store, timeout_s)
        future = store.future
        if isinstance(future, WaitingFuture):
            future.on_cancel = lambda: self._forget(store)

    def wake(self) -> None:
        """Room may have appeared: retry every waiting store now, oldest first, and queue each
        one that finds room (its GPU blocks then pass from this hold to the queued copy)."""
        if not self._waiting:
            return
        for part in self._settle():  # the recorded stores first: their keys are indexed
            self._enqueue(part)
        for store in list(self._waiting):
            if store.future.done():  # cancelled
                self._forget(store)
                continue
            try:
                part = store.attempt(store.future)
            except PoolExhaustedError as exc:
                store.needed, store.available = exc.needed, exc.available
                continue
            except Exception as exc:  # a state-dependent refusal (a key cycle): fail the store
                self._forget(store)
                store.future.set_exception(exc)
                continue
            self._forget(store)  # the part holds its own counts now
            self.num_requeued += 1
            self._enqueue(part)

    def fail(self, error: BaseException) -> None:
        """Fail every waiting store with ``error`` (the manager closes) and drop their holds."""
        for store in list(self._waiting):
            self._forget(store)
            if not store.future.done():
                store.future.set_exception(error)

    def _expire(self, store: WaitingStore, timeout_s: float) -> None:
        if store not in self._waiting:
            return
        self._forget(store)
        if store.future.done():
            return
        self._counters.reject("timeout")
        store.future.set_exception(
            PoolExhaustedError(
                f"cpu tier: no room for {store.needed} blocks within store_wait_s={timeout_s} s "
                f"({store.available} free or evictable). Room appears when stores complete "
                "(their keys become evictable), loads end (their keys are unpinned), requests "
                "are freed or keys invalidated; raise store_wait_s or num_cpu_blocks, or store "
                "fewer blocks per call",
                needed=store.needed,
                available=store.available,
                reason="timeout",
            )
        )

    def _forget(self, store: WaitingStore) -> None:
        """Drop a store from the waiters and release its hold (once)."""
        try:
            self._waiting.remove(store)
        except ValueError:
            return
        if store.timer is not None:
            store.timer.cancel()
        self._gpu.release(store.gpu_ids)
