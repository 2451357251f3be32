"""An asyncio event loop on its own daemon thread, for kvmgr's async tiers under vLLM's sync calls.

vLLM calls a secondary tier from its scheduler thread and wants every call non-blocking; kvmgr's
tiers are ``async``. `LoopThread` runs one loop per tier manager: ``submit(coro)`` hands a
coroutine over and returns a ``concurrent.futures.Future`` at once; ``run(coro)`` waits (setup
and shutdown only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One event loop running on a daemon thread named ``name``; `close` stops and joins it."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; never blocks."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (not from the loop's own thread)."""
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        """Stop the loop after the callbacks queued so far, join the thread, close the loop."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
