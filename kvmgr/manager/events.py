"""The KV event stream: what entered and left each tier, in the order it happened.

Private to ``kvmgr.manager``; ``OffloadManager.take_events()`` and ``OffloadManager.events()``
are its public face. A KV-aware router or an external index drains it to know which prefixes an
instance holds (the role of vLLM's KV events). The stream is bounded: when nobody drains it,
the oldest events are dropped and counted (``ManagerStatistics.events_dropped``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

from kvmgr.reports import KVEvent

__all__ = ["EventStream"]


class EventStream:
    """A bounded FIFO of ``KVEvent`` with an async consumer side.

    Args:
        max_events: events kept; 0 disables the stream (nothing is recorded).
    """

    def __init__(self, max_events: int) -> None:
        self.enabled = max_events > 0
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=max(1, max_events))
        self.num_dropped = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._events) if self.enabled else 0

    def emit(self, kind: str, keys: list[bytes], tier: str = "cpu") -> None:
        """Append one event (no-op when disabled or ``keys`` is empty)."""
        if not self.enabled or not keys:
            return
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append(KVEvent(kind, tuple(keys), tier))
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def close(self) -> None:
        """No more events: iterators drain what is left, then stop."""
        self._closed = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def stored(self, keys: list[bytes]) -> None:
        self.emit("stored", keys)

    def removed(self, keys: list[bytes]) -> None:
        self.emit("removed", keys)

    def take(self) -> list[KVEvent]:
        """Remove and return every event, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    async def iterate(self) -> AsyncIterator[KVEvent]:
        """Yield events as they happen, until the manager closes (then the iteration ends once
        the events recorded before the close were yielded)."""
        loop = asyncio.get_running_loop()
        while True:
            while self._events:
                yield self._events.popleft()
            if self._closed:
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
