"""Fake time for asyncio tests.

Offers:
    VirtualClock   monotonic fake time for an event loop, advanced only by the test
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["VirtualClock"]

T = TypeVar("T")


class VirtualClock:
    """Monotonic fake time for an asyncio event loop; it moves only when the test says so.

    The loop's ``time()`` is replaced by this clock, so everything built on loop timers
    (``asyncio.sleep``, ``asyncio.wait_for``, ``OffloadManager.wait`` deadlines and the
    ``backpressure="wait"`` bound) waits in virtual seconds: a 30 s timeout fires the moment the
    test calls ``advance(30)``, and never before. Work done on threads (engine copies) still
    takes real time; callbacks from threads wake the loop as usual.

    Use ``clock.run(main())`` (like ``asyncio.run``) or, inside an already running loop (for
    example a pytest-asyncio test), ``with clock.install(asyncio.get_running_loop()): ...``.
    A test that awaits something only a later ``advance`` can finish waits forever: give the
    test suite a global timeout.

    Args:
        start_s: initial time; ``install`` starts from the loop's current time instead, so
            timers already scheduled keep their meaning.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = float(start_s)

    def time(self) -> float:
        """Current virtual time, seconds."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward; timers that became due run at the loop's next iteration.

        Raises:
            TypeError: ``seconds`` is not a real number (a ``bool`` neither).
            ValueError: ``seconds`` is negative or NaN (time is monotonic).
        """
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
            raise TypeError(f"expected seconds as a real number, got {seconds!r}")
        if not seconds >= 0:
            raise ValueError(f"expected seconds >= 0, got {seconds!r}")
        self._now += seconds

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        """A new event loop whose ``time()`` is this clock."""
        loop = asyncio.new_event_loop()
        loop.time = self.time  # type: ignore[method-assign]
        return loop

    @contextlib.contextmanager
    def install(self, loop: asyncio.AbstractEventLoop) -> Iterator[VirtualClock]:
        """Make ``loop`` (typically the running one) use this clock until the block exits.

        Time continues from the loop's current time. On exit the loop's own clock is restored;
        timers scheduled meanwhile then fire by real time again.
        """
        self._now = loop.time()
        loop.time = self.time  # type: ignore[method-assign]
        try:
            yield self
        finally:
            del loop.time

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run ``main`` to completion on a new virtual-time loop, then close the loop (after
        cancelling leftover tasks and shutting down async generators, like ``asyncio.run``)."""
        loop = self.new_event_loop()
        try:
            return loop.run_until_complete(main)
        finally:
            try:
                leftovers = asyncio.all_tasks(loop)
                for task in leftovers:
                    task.cancel()
                if leftovers:
                    gather = asyncio.gather(*leftovers, return_exceptions=True)
                    loop.run_until_complete(gather)
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
