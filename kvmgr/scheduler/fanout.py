"""One shared outcome for the per-call stores recorded between two settles, one future per call.

Private to ``kvmgr.scheduler`` (the manager hands ``CallFuture`` out). Every plain ``swap_out``
recorded since the last settle (``deferred``) gets a ``CallFuture``: two references (the
``StoreFanOut`` of its settle, its call number) and nothing else, so a call costs one small
object and no ``SwapResult`` until someone asks for one. The fan-out is the future of the one
``Part`` the settle makes; the flusher resolves it once (``set_result`` / ``set_exception``),
which schedules the done callbacks of the calls that have any (tasks awaiting them, ``gather``)
and nothing else. ``result()`` builds the call's ``SwapResult`` from the fan-out's id arrays on
first use.

``CallFuture`` follows ``asyncio.Future``'s protocol (``done``, ``result``, ``exception``,
``cancel``, ``add_done_callback``, ``get_loop``, ``__await__``, ``_asyncio_future_blocking``):
asyncio's tasks, ``gather``, ``wait``, ``wait_for`` and ``shield`` take it as they take any
future, ``asyncio.isfuture`` is true. Cancelling one call (its awaiting task, or ``cancel()``)
cancels that call only: its copy runs on, the other calls and the shared outcome are untouched.
A call may also be resolved on its own (``set_result`` / ``set_exception``: the settle's
one-by-one fallback); that outcome then wins over the shared one.
"""

from __future__ import annotations

import array
import asyncio
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from kvmgr.reports import SwapResult

__all__ = ["CallFuture", "StoreFanOut"]

_new = tuple.__new__  # a SwapResult from its fields without the NamedTuple's Python __new__
_PENDING, _OK, _FAILED, _CANCELLED = 0, 1, 2, 3


class StoreFanOut:
    """The shared outcome of the per-call stores recorded between two settles.

    ``add_call`` numbers the calls as they are recorded; ``prepared`` (at the settle) gives
    the ids: call ``i`` covers entries ``ends[i - 1]:ends[i]`` of ``gpu_ids`` / ``cpu_ids``
    (``ends`` ``None``: one block per call). Then it is the ``Part``'s future: ``set_result``
    / ``set_exception`` resolve every call not resolved on its own, in call order.

    Args:
        loop: the event loop the done callbacks run on.
    """

    __slots__ = (
        "block_bytes", "callbacks", "cpu_ids", "ends", "error", "gpu_ids", "loop", "num_calls",
        "own", "state",
    )  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.num_calls = 0  #: the calls recorded (what ``SwapQueue`` counts)
        self.state = _PENDING
        self.error: BaseException | None = None
        #: call -> [its CallFuture, (fn, context), ...] for calls not done yet with callbacks
        self.callbacks: dict[int, list[Any]] = {}
        #: call -> (state, value) for calls cancelled or resolved on their own
        self.own: dict[int, tuple[int, Any]] = {}
        self.ends: array.array[int] | None = None
        self.gpu_ids: array.array[int] | list[int] = []
        self.cpu_ids: array.array[int] | list[int] = []
        self.block_bytes = 0

    def add_call(self) -> CallFuture:
        """A new call's future (numbered in call order)."""
        call = CallFuture()
        call._fan = self
        call._i = self.num_calls
        self.num_calls += 1
        return call

    def calls(self) -> list[CallFuture]:
        """A future for each call, in call order: each reads and resolves the state of that
        call as the caller's own future does (another object over the same call)."""
        calls: list[CallFuture] = [CallFuture() for _ in range(self.num_calls)]
        for i, call in enumerate(calls):
            call._fan, call._i = self, i
        return calls

    def prepared(
        self, ends: array.array[int] | None, gpu_ids: np.ndarray, cpu_ids: np.ndarray, size: int
    ) -> None:
        """The calls' ids, known at the settle (int64 ``[n]`` each), and the bytes of a block
        (kept as ``array.array``: a copy of the bytes, no int object until a result reads it)."""
        self.ends, self.block_bytes = ends, size
        self.gpu_ids = array.array("q", gpu_ids.tobytes())  # 0.3 us for 512 (tolist: 6.5)
        self.cpu_ids = array.array("q", cpu_ids.tobytes())

    # ------------------------------------------------------------------ the part's future

    def done(self) -> bool:
        return False  # the calls are resolved each on its own (their own or the shared state)

    def exception(self) -> None:
        return None

    def set_result(self, _value: object) -> None:
        """Every call not resolved on its own succeeded."""
        if self.state == _PENDING:
            self.state = _OK
            self._fire_all()

    def set_exception(self, error: BaseException) -> None:
        """Every call not resolved on its own fails with ``error`` (nothing is logged for an
        outcome nobody retrieves: the manager counts failures)."""
        if self.state == _PENDING:
            self.state, self.error = _FAILED, error
            self._fire_all()

    # ------------------------------------------------------------------ per call

    def result_of(self, i: int) -> SwapResult:
        """Call ``i``'s ``SwapResult`` (blocks, bytes, CPU and GPU ids)."""
        ends, cpu, gpu = self.ends, self.cpu_ids, self.gpu_ids
        if ends is None:
            c, g = cpu[i], gpu[i]
            return _new(SwapResult, (1, self.block_bytes, 0, (c,), (g,)))
        start, end = (ends[i - 1] if i else 0), ends[i]
        n = end - start
        ids = tuple(cpu[start:end]), tuple(gpu[start:end])
        return _new(SwapResult, (n, n * self.block_bytes, 0, *ids))

    def state_of(self, i: int) -> tuple[int, Any]:
        own = self.own.get(i) if self.own else None
        if own is not None:
            return own
        return self.state, self.error

    def resolve(self, i: int, state: int, value: Any) -> None:
        """Resolve call ``i`` on its own (cancelled, or the one-by-one fallback)."""
        self.own[i] = (state, value)
        entries = self.callbacks.pop(i, None)
        if entries:
            call, call_soon = entries[0], self.loop.call_soon
            for fn, context in entries[1:]:
                call_soon(fn, call, context=context)

    def _fire_all(self) -> None:
        callbacks = self.callbacks
        if not callbacks:
            return
        self.callbacks = {}
        call_soon = self.loop.call_soon
        for i in sorted(callbacks):  # call order, as separate futures would be resolved
            entries = callbacks[i]
            call = entries[0]
            for fn, context in entries[1:]:
                call_soon(fn, call, context=context)


class CallFuture:
    """The future of one recorded per-call store: ``asyncio.Future``'s protocol over a
    ``StoreFanOut`` (see the module docstring). Resolves to the call's ``SwapResult``.

    Made by ``StoreFanOut.add_call`` (or ``DeferredStores.record_one``): ``CallFuture()``
    then ``_fan`` and ``_i``, nothing else per call; the other slots stay unset until used
    (``_blocking`` by an awaiting task, ``_result`` by the first ``result()``)."""

    __slots__ = ("_blocking", "_fan", "_i", "_result")

    _fan: StoreFanOut
    _i: int
    _result: SwapResult  #: built on the first ``result()`` (unset before)

    @property
    def _asyncio_future_blocking(self) -> bool:
        """asyncio's flag (``asyncio.isfuture`` reads it, a task sets it after a yield)."""
        return getattr(self, "_blocking", False)  # type: ignore[no-any-return]

    @_asyncio_future_blocking.setter
    def _asyncio_future_blocking(self, value: bool) -> None:
        self._blocking = value

    @property
    def _cancel_message(self) -> Any:
        """asyncio's field: ``gather(..., return_exceptions=True)`` reads it of a cancelled one."""
        state, value = self._fan.state_of(self._i)
        return value if state == _CANCELLED else None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._fan.loop

    def done(self) -> bool:
        fan = self._fan
        return fan.state != _PENDING or (bool(fan.own) and self._i in fan.own)

    def cancelled(self) -> bool:
        return self._fan.state_of(self._i)[0] == _CANCELLED

    def cancel(self, msg: Any = None) -> bool:
        """Cancel this call's future (not the copy, not the other calls); ``False`` if done."""
        if self.done():
            return False
        self._fan.resolve(self._i, _CANCELLED, msg)
        return True

    def _make_cancelled_error(self) -> asyncio.CancelledError:
        msg = self._fan.state_of(self._i)[1]
        return asyncio.CancelledError() if msg is None else asyncio.CancelledError(msg)

    def result(self) -> Any:
        """The call's ``SwapResult``.

        Raises:
            asyncio.CancelledError, asyncio.InvalidStateError (not done), or the swap's error.
        """
        fan = self._fan
        if fan.state == _OK and not fan.own:  # the common case: every call succeeded
            result = getattr(self, "_result", None)
            if result is None:
                self._result = result = fan.result_of(self._i)
            return result
        state, value = fan.state_of(self._i)
        if state == _OK:
            if self._i in fan.own:
                return value
            result = getattr(self, "_result", None)
            if result is None:
                self._result = result = fan.result_of(self._i)
            return result
        if state == _FAILED:
            raise value
        if state == _CANCELLED:
            raise self._make_cancelled_error()
        raise asyncio.InvalidStateError("Result is not ready.")

    def exception(self) -> BaseException | None:
        """The swap's error, or ``None`` after a success.

        Raises:
            asyncio.CancelledError, asyncio.InvalidStateError (not done).
        """
        state, value = self._fan.state_of(self._i)
        if state == _OK:
            return None
        if state == _FAILED:
            return value  # type: ignore[no-any-return]
        if state == _CANCELLED:
            raise self._make_cancelled_error()
        raise asyncio.InvalidStateError("Exception is not set.")

    def set_result(self, value: Any) -> None:
        """Resolve this call on its own. Raises asyncio.InvalidStateError: already done."""
        if self.done():
            raise asyncio.InvalidStateError(f"invalid state: {self!r}")
        self._fan.resolve(self._i, _OK, value)

    def set_exception(self, error: BaseException) -> None:
        """Fail this call on its own. Raises asyncio.InvalidStateError: already done."""
        if self.done():
            raise asyncio.InvalidStateError(f"invalid state: {self!r}")
        self._fan.resolve(self._i, _FAILED, error)

    def add_done_callback(self, fn: Callable[[Any], object], *, context: Any = None) -> None:
        """Run ``fn(self)`` on the loop (``call_soon``) once the call is done."""
        fan = self._fan
        if self.done():
            fan.loop.call_soon(fn, self, context=context)
            return
        entries = fan.callbacks.get(self._i)
        if entries is None:
            fan.callbacks[self._i] = entries = [self]
        entries.append((fn, context))

    def remove_done_callback(self, fn: Callable[[Any], object]) -> int:
        """Remove every registration of ``fn``; returns how many."""
        entries = self._fan.callbacks.get(self._i)
        if not entries:
            return 0
        kept = [e for e in entries[1:] if e[0] != fn]
        removed = len(entries) - 1 - len(kept)
        if kept:
            entries[1:] = kept
        else:
            del self._fan.callbacks[self._i]
        return removed

    def __await__(self) -> Generator[Any, None, Any]:
        fan = self._fan
        if fan.state == _PENDING and not (fan.own and self._i in fan.own):
            self._blocking = True
            yield self
            if not self.done():
                raise RuntimeError("await wasn't used with future")
        return self.result()

    __iter__ = __await__

    def __repr__(self) -> str:
        state, _ = self._fan.state_of(self._i)
        name = ("pending", "finished", "failed", "cancelled")[state]
        return f"<CallFuture {name} call={self._i}>"
