"""Forward a manager's KV event stream to a publisher as it happens.

Offers:
    forward_events   ``await forward_events(mgr, publisher)``: one published batch per wake-up
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvmgr.reports import KVEvent

__all__ = ["EventSink", "forward_events"]


class EventSink(Protocol):
    """What ``forward_events`` publishes to (``ZmqEventPublisher`` is one)."""

    def publish(self, events: Sequence[KVEvent]) -> None: ...


async def forward_events(manager: Any, sink: EventSink) -> int:
    """Publish every KV event of ``manager`` to ``sink`` until the manager closes.

    Run it as a task beside the serving loop (``asyncio.create_task(forward_events(mgr,
    publisher))``). Each time the stream wakes it, everything recorded since becomes one batch
    (stores that landed together, the removals that made room for them), in order; the last
    batch carries the ``cleared`` event of the close. It is the stream's consumer: do not also
    drain ``take_events()`` / ``events()`` elsewhere, or those events are not published.

    Cancelling it loses nothing recorded: events not yet taken stay in the stream.

    Returns:
        The number of batches published.
    """
    num_batches = 0
    async for event in manager.events():
        sink.publish([event, *manager.take_events()])
        num_batches += 1
    return num_batches
