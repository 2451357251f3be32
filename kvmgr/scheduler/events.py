"""The KV event stream: what entered and left each tier, in the order it happened.

Private to ``kvmgr.scheduler``; ``OffloadManager.take_events()`` and ``OffloadManager.events()``
are its public face. A KV-aware router or an external index drains it to know which prefixes an
instance holds (the role of vLLM's KV events). The stream is bounded: when nobody drains it,
the oldest events are dropped and counted (``ManagerStatistics.events_dropped``).

Order is the promise a router relies on (vllm #57159: never advertise a block the tier cannot
serve): ``stored`` only once the copy has landed, ``removed`` before the block is reused (the
eviction is recorded when the store that needs the room is prepared, before its copy is
submitted), ``cleared`` last, when the manager closes (nothing is recorded after it, not even
a lower-tier write that ends after the close). ``kvmgr.events`` turns the stream into vLLM's
wire format and publishes it over ZMQ.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Sequence

import numpy as np

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

    def emit(
        self,
        kind: str,
        keys: list[bytes],
        tier: str = "cpu",
        parents: Sequence[bytes | None] | None = None,
        token_ids: np.ndarray | None = None,
    ) -> None:
        """Append one event (no-op when disabled, once closed, or when ``keys`` is empty).
        ``parents`` and ``token_ids`` (aligned with ``keys``) are the router detail of a
        ``stored`` event. After ``close`` nothing is recorded: ``cleared`` stays the last event
        (a lower-tier write that outlived ``aclose``'s wait ends later and would otherwise
        advertise blocks of a closed instance)."""
        if not self.enabled or not keys or self._closed:
            return
        self._append(
            KVEvent(kind, tuple(keys), tier, None if parents is None else tuple(parents), token_ids)
        )

    def _append(self, event: KVEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append(event)
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

    def stored(
        self,
        keys: list[bytes],
        parents: Sequence[bytes | None] | None = None,
        token_ids: np.ndarray | None = None,
    ) -> None:
        self.emit("stored", keys, "cpu", parents, token_ids)

    def removed(self, keys: list[bytes]) -> None:
        self.emit("removed", keys)

    def cleared(self) -> None:
        """The manager closed: every key it advertised, in every tier, is gone for it."""
        if self.enabled and not self._closed:
            self._append(KVEvent("cleared", (), "all"))

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
