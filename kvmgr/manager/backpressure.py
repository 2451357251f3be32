"""Backpressure for stores that find the CPU tier full: fail at once, or wait (bounded).

Private to ``kvmgr.manager``. With ``backpressure="wait"`` a store that cannot make room
becomes a task that retries whenever room may have appeared (a copy completed, a request was
freed, keys were invalidated), until ``store_wait_s`` seconds passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvmgr.config import ManagerConfig
from kvmgr.errors import PoolExhaustedError
from kvmgr.manager.counters import Counters
from kvmgr.manager.queue import Part

__all__ = ["RoomWaiters"]


class RoomWaiters:
    """Futures of stores waiting for room, woken together."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self._waiters)

    def wake(self) -> None:
        """Room may have appeared: wake every waiting store (each retries)."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        """Fail every waiting store with ``error`` (the manager closes)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)

    async def retry(
        self,
        loop: asyncio.AbstractEventLoop,
        attempt: Callable[[asyncio.Future[Any]], Part],
        enqueue: Callable[[Part], None],
        deadline: float,
        config: ManagerConfig,
        counters: Counters,
    ) -> Any:
        """Retry ``attempt`` (a store's prepare) until it finds room or ``deadline`` passes.

        Raises:
            PoolExhaustedError: (reason ``"timeout"``) no room by the deadline.
            Whatever the store itself raises (``TransferError``, ``ClosedError``).
        """
        while True:
            future: asyncio.Future[Any] = loop.create_future()
            try:  # room may have appeared before this task first ran
                part = attempt(future)
            except PoolExhaustedError as exc:
                needed, available = exc.needed, exc.available
            else:
                enqueue(part)
                return await future
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                counters.reject("timeout")
                raise PoolExhaustedError(
                    f"cpu tier: no room for {needed} blocks within {config.store_wait_s} s",
                    needed=needed,
                    available=available,
                    reason="timeout",
                ) from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
