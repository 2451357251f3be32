"""The manager's shared core: its parts, its state checks, the deferred settle, the queue's door.

Private to ``kvmgr.manager``. ``ManagerCore`` holds what ``build`` made (worker, scheduler,
flusher, transport, waiting stores, lower tiers) and the few helpers every group of calls uses:
``_check_open`` / ``_check_not_closed`` (which settle the recorded per-call stores first,
``kvmgr.scheduler.deferred``), ``_enqueue`` and the end-of-tick flush; ``check_timeout`` is
the one rule for the ``timeout_s`` of ``wait``, ``close``, ``aclose`` and ``drain_tiers``. The public calls are
grouped in ``keyed``, ``request_calls``, ``staged_calls`` and ``observe``, each a class over this
one; ``facade.OffloadManager`` joins them.

The running loop: asyncio's ``get_running_loop`` calls ``getpid()`` on every call (a system call,
0.17-0.34 us on the 2-core VM: a fifth of a per-call store), so once a call found the bound
loop running, the next ones test only that it still runs in this thread (``_fast_loop``, an
asyncio ``BaseEventLoop``: its ``_thread_id`` is set while it runs, and one thread runs one loop
at a time); a forked child forgets it (``os.register_at_fork``: the parent's loop is not
running there), and closing clears it.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import threading
import weakref
from asyncio.base_events import BaseEventLoop
from collections.abc import Sequence
from typing import Any

from kvmgr.config import ManagerConfig
from kvmgr.errors import (
    ClosedError,
    ConfigError,
    EventLoopError,
    InvalidArgumentError,
)
from kvmgr.hooks import StepHook
from kvmgr.manager.build import Parts
from kvmgr.manager.layerwise import LayerLayouts
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler.queue import Part
from kvmgr.transfer.engine import TransferEngine
from kvmgr.transfer.layerwise import LayerwiseStore
from kvmgr.worker import TransferWorker

__all__ = ["ManagerCore", "check_timeout"]

_get_ident = threading.get_ident
_fast_bound: weakref.WeakSet[ManagerCore] = weakref.WeakSet()  #: managers with a ``_fast_loop``


def _forget_fast_loops() -> None:
    """In a forked child: no loop of the parent is running (asyncio's check says so too)."""
    for manager in list(_fast_bound):
        manager._fast_loop = None


os.register_at_fork(after_in_child=_forget_fast_loops)


def check_timeout(timeout_s: object) -> float | None:
    """``timeout_s`` (seconds) as a float, or ``None`` (no bound).

    Raises:
        InvalidArgumentError: not ``None`` or a real number (bools refused), negative, NaN or
            infinite (pass ``None`` for no bound).
    """
    if timeout_s is None:
        return None
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, numbers.Real)
        or not (math.isfinite(timeout_s) and timeout_s >= 0)
    ):
        raise InvalidArgumentError(
            f"expected timeout_s >= 0 seconds (finite) or None, got "
            f"{type(timeout_s).__name__}: {timeout_s!r:.40}"
        )
    return float(timeout_s)


class ManagerCore:
    """State and helpers shared by the groups of public calls (see the module docstring)."""

    def _adopt(self, parts: Parts, config: ManagerConfig, hooks: Sequence[StepHook]) -> None:
        self.config = config
        self._worker = parts.worker
        self._scheduler = parts.scheduler
        self._books = parts.scheduler.books
        self._deferred = self._books.deferred  # plain per-call stores recorded, not prepared
        self._queue = parts.scheduler.queue
        self._flusher = parts.flusher
        self._transport = parts.flusher.transport
        self._room = parts.room
        self._tiers = parts.tiers
        self._hooks = list(hooks)
        self._loop: asyncio.AbstractEventLoop | None = None  # the one holder of the loop
        self._layerwise_stores: list[LayerwiseStore] = []  # aborted at close if unfinished
        self._layer_layouts = LayerLayouts()
        self._flush_on_tick = config.flush == "tick"
        self._tick_scheduled = False
        self._closing = False
        self._closed = False
        #: the bound loop while open, once seen running here (an asyncio ``BaseEventLoop``)
        self._fast_loop: Any = None
        self._step = 0

    @property
    def engine(self) -> TransferEngine:
        """The local worker's transfer engine (``None`` over ranks)."""
        return None if self._worker is None else self._worker.engine  # type: ignore[return-value]

    @property
    def gpu_layout(self) -> KVLayout:
        """The local worker's GPU KV layout (``None`` over ranks)."""
        return None if self._worker is None else self._worker.gpu_layout  # type: ignore[return-value]

    @property
    def closed(self) -> bool:
        """Whether ``close``/``aclose`` has been called."""
        return self._closed

    @property
    def policy(self) -> Any:
        """The CPU tier's eviction policy (read it; do not drive it)."""
        self._settle_deferred()
        return self._books.cpu.policy

    @property
    def cpu_pool(self) -> Any:
        """The CPU tier's memory (``HostKVPool``: one ``uint8 [num_cpu_blocks, page_bytes]``
        view per KV tensor)."""
        return None if self._worker is None else self._worker.cpu_pool

    def _check_open(self) -> asyncio.AbstractEventLoop:
        loop = self._open_loop()
        if self._deferred.fan is not None:
            self._settle_deferred()
        return loop

    def _settle_deferred(self) -> None:
        """Prepare and queue the per-call stores recorded so far (``scheduler.deferred``):
        before anything reads or changes the bookkeeping, so every call sees what it would
        have seen had each store been prepared at its call."""
        for part in self._books.settle_deferred():
            self._enqueue(part)

    def _open_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, bound to the manager; the bound one when it still runs in this
        thread (see the module docstring).

        Raises:
            ClosedError: closed or closing. EventLoopError: no running loop, or swaps queued
                or in flight on the bound loop while another runs.
        """
        loop: Any = self._fast_loop
        if loop is not None and loop._thread_id == _get_ident():
            return loop  # type: ignore[no-any-return]
        if self._closed or self._closing:
            raise ClosedError("the manager is closed")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise EventLoopError(
                "swaps need a running asyncio event loop: call them from a coroutine "
                "(for example inside asyncio.run(main()))"
            ) from None
        if loop is not self._loop:
            if self._loop is not None and (
                self._queue.in_flight or len(self._queue) or self._deferred.fan is not None
            ):
                raise EventLoopError(
                    "the manager has swaps queued or in flight on another event loop; "
                    "use one manager per loop"
                )
            self._loop = loop  # rebind: nothing pending on the old loop
        if isinstance(loop, BaseEventLoop) and loop._thread_id == _get_ident():  # type: ignore[attr-defined]
            self._fast_loop = loop
            _fast_bound.add(self)
        return loop

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ClosedError("the manager is closed")
        if self._deferred.fan is not None:
            self._settle_deferred()

    def _enqueue(self, part: Part) -> None:
        if not self._scheduler.enqueue(part):  # nothing to copy: resolve now, no batch
            part.future.set_result(part.result)
            return
        if self._flush_on_tick:
            assert self._loop is not None
            self._tick_soon(self._loop)

    def _tick_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """``flush="tick"``: flush at the end of this tick (once per tick)."""
        if not self._tick_scheduled:
            self._tick_scheduled = True
            loop.call_soon(self._flush_tick)

    def _flush_tick(self) -> None:
        self._tick_scheduled = False
        if not self._closed:
            assert self._loop is not None
            self._settle_deferred()
            self._flusher.flush(self._loop)

    def _local_worker(self, what: str) -> TransferWorker:
        """Raises ConfigError: the copies run in other processes (``over_ranks``)."""
        if self._worker is None:
            raise ConfigError(f"{what} needs the in-process worker; not supported over ranks")
        return self._worker

    def _is_open(self) -> bool:
        return not (self._closed or self._closing)

    def _abort_layerwise(self) -> None:
        for store in self._layerwise_stores:
            store.abort()
        self._layerwise_stores = []
