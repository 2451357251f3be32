"""One scripted engine for tests: copies on a real engine (or not at all) and lies on cue.

Offers:
    ScriptedEngine   a ``TransferEngine`` whose batches fail, hang, wait, are refused, are
                     delayed, are rewritten or are only recorded, as the test scripts them;
                     with no inner engine it copies nothing (host-path benchmarks)
    POISON_BYTE      what it writes over the CPU blocks of a failed store

``FaultyEngine`` and ``NullEngine`` (``kvmgr.testing.faults``) are this engine under the names
the testing guide uses.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvmgr.errors import ClosedError, ConfigError, TransferError, TransferTimeoutError
from kvmgr.testing._controls import ScriptControls
from kvmgr.testing._hooks import EngineHooks
from kvmgr.testing._no_copy import completed_handle, count_batch, no_copy_result
from kvmgr.testing._order import Batch, BatchOrder, closed_before_copy
from kvmgr.testing._script import POISON_BYTE, FaultScript
from kvmgr.transfer.engine import (
    BatchHandle,
    BatchResult,
    BatchTotals,
    EngineStatistics,
    TransferEngine,
)
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["POISON_BYTE", "ScriptedEngine"]

#: ``on_submit(batch_id, plan)``: observe a batch (return ``None``), replace the plan its copy
#: runs (return the new plan), or raise (``submit`` raises it: an engine with a bug).
SubmitHook = Callable[[int, TransferPlan], "TransferPlan | None"]


class ScriptedEngine(ScriptControls, TransferEngine):
    """A ``TransferEngine`` that runs every copy on ``inner`` (none: copies nothing) and does to
    each batch what the test scripted.

    Batches are numbered ``0, 1, 2, ...`` in the order ``submit`` is called. Batch ``k``:

    - in ``refuse_batches``: ``submit`` raises ``TransferError`` (nothing is copied);
    - in ``refuse_issue_batches``: ``submit`` returns a handle whose ``refused`` holds a
      ``TransferError`` (a CUDA engine's refused launch); nothing is copied and the batch
      fails, in order;
    - in ``hang_batches``: its copy does not start until ``complete_next``, ``release`` or
      ``close`` (the outer future stays pending: a completion that never arrives);
    - in ``fail_batches``, true for ``fail_when(k, plan)``, or drawn with probability
      ``fail_rate`` from ``random.Random(seed)`` (one draw per batch): the copy runs, then the
      batch fails with ``TransferError``. A failed store's destination CPU pages are
      overwritten with ``POISON_BYTE`` (when ``poison``), so a manager that marked them READY
      would serve poison;
    - otherwise it completes, ``delay_s`` seconds after the copy ended.

    Order is kept as a real stream keeps it: a batch's copy starts only after the copies of the
    previous batch of its direction and of its ``wait_for`` batches were handed on (so a hung
    batch stalls its direction), and outer futures resolve in that order too.

    ``hold()`` (or ``hold=True``) gates every later batch the same way as a hung one;
    ``complete_next(n)`` then starts the ``n`` oldest gated batches, ``release()`` all of them.
    With an inner engine the copy runs there and the outer future resolves on an engine thread
    shortly after (await the manager's future to observe it); without one, a batch resolves
    inside ``submit``/``complete_next`` on the caller's thread.

    Args:
        inner: the engine that really copies (closed by ``close``), or ``None``: nothing is
            copied; ``allocate_host`` returns uninitialised CPU memory.
        fail_batches / hang_batches / refuse_batches: batch numbers to fail, hang, refuse.
        fail_when: ``(batch_id, plan) -> bool``, evaluated at submit: fail the batch.
        fail_rate: probability in ``[0, 1]`` that any other batch fails.
        fail_directions: directions ``fail_rate`` applies to (for example only
            ``Direction.D2H``, for a caller that cannot survive a failed load).
        delay_s: seconds between a copy's end and its completion (real time; waited on a
            worker thread started on first use and joined by ``close``).
        seed: seed of the failure draws.
        poison: overwrite the destination of failed stores with ``POISON_BYTE``.
        hold: gate every batch from the start (as ``hold()``).
        on_submit: a ``SubmitHook``, called first in every ``submit``.
        record: keep ``(plan, wait_for, handle)`` of every batch in ``submitted``.
        close_hangs: ``close`` leaves gated batches pending and raises ``TransferTimeoutError``
            when there are any (a CUDA engine whose stream hung).
        end_events: give every handle an ``end_event`` (a stand-in object, as a CUDA engine's
            handles carry), so layerwise loads wait with ``stream_wait``; every ``stream_wait``
            call's batch id is kept in ``stream_waits``.
        hooks: the optional engine methods the manager looks up (``plan_duplex``,
            ``plan_duplex_plans``, ``allocate_host_region``: ``kvmgr.testing._hooks``), set on
            this engine; host regions they return are closed by ``close``.
        name: the engine's ``name`` and its results' ``path``.

    Raises:
        ConfigError: ``fail_rate`` outside ``[0, 1]``, negative ``delay_s``, ``inner`` not a
            ``TransferEngine``, or an unknown hook.
    """

    def __init__(
        self,
        inner: TransferEngine | None = None,
        *,
        fail_batches: Collection[int] = (),
        fail_when: Callable[[int, TransferPlan], bool] | None = None,
        fail_rate: float = 0.0,
        fail_directions: Collection[Direction] = (Direction.D2H, Direction.H2D),
        delay_s: float = 0.0,
        hang_batches: Collection[int] = (),
        refuse_batches: Collection[int] = (),
        refuse_issue_batches: Collection[int] = (),
        seed: int = 0,
        poison: bool = True,
        hold: bool = False,
        on_submit: SubmitHook | None = None,
        record: bool = False,
        close_hangs: bool = False,
        end_events: bool = False,
        hooks: Mapping[str, Callable[..., Any]] | None = None,
        name: str | None = None,
    ) -> None:
        if inner is not None and not isinstance(inner, TransferEngine):
            raise ConfigError(f"expected a TransferEngine, got {type(inner).__name__}")
        self.inner = inner
        self.name = name or ("null" if inner is None else f"faulty({inner.name})")
        self.max_descriptors = self.max_descriptors if inner is None else inner.max_descriptors
        self._script = FaultScript(fail_batches, hang_batches, refuse_batches, fail_when, fail_rate,
                                   fail_directions, seed, poison, refuse_issue_batches)  # fmt: skip
        self.injected = self._script.injected  #: batch id -> the fault (``FaultScript``)
        self._on_submit, self._record, self._end_events = on_submit, record, end_events
        self.stream_waits: list[int] = []  #: batch ids ``stream_wait`` was called with
        self._hooks = EngineHooks(hooks or {}, self)
        self._close_hangs, self._order = close_hangs, BatchOrder(self._start, delay_s)
        self._holding, self._closed, self._next_batch_id = hold, False, 0
        self._totals = BatchTotals()  # without an inner engine: this engine's own
        #: with ``record``: ``(plan, wait_for, handle)`` per submitted batch, in order
        self.submitted: list[tuple[TransferPlan, tuple[BatchHandle, ...], BatchHandle]] = []
        plain = not (delay_s or on_submit or record or end_events) and self._script.is_empty
        self._plain = plain and inner is None  # resolved in submit, unordered (host benchmarks)

    # ------------------------------------------------------------------ engine protocol

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """The inner engine's host allocation (uninitialised CPU memory without one)."""
        if self.inner is None:
            return torch.empty(num_bytes, dtype=torch.uint8)
        return self.inner.allocate_host(num_bytes)

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Number the batch, decide its fate, and start its copy when its order allows.

        Raises:
            ClosedError: the engine is closed.
            TransferError: the batch is in ``refuse_batches``, or a ``wait_for`` handle was not
                returned by this engine.
            Exception: whatever ``on_submit`` raises.
        """
        if self._closed:
            raise ClosedError(f"{self.name} engine is closed")
        if self._plain and not self._holding and not self._order.batches:  # done at once
            self._next_batch_id += 1
            return completed_handle(self._totals, self._next_batch_id - 1, plan, self.name)
        order = self._order
        with order.lock:
            preds = [order.by_id.get(h.batch_id) for h in wait_for]
            for handle, pred in zip(wait_for, preds):
                if pred is not None and pred.handle is not handle:
                    raise TransferError(f"wait_for batch {handle.batch_id} is not from this engine")
            batch_id = self._next_batch_id
            copy_plan = (self._on_submit and self._on_submit(batch_id, plan)) or plan
            self._next_batch_id += 1
            fate = self._script.fate(batch_id, plan)
            future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
            future.set_running_or_notify_cancel()  # like an executor's: cannot be cancelled
            end_event = object() if self._end_events else None  # a CUDA engine's has one
            handle = BatchHandle(batch_id, plan.direction, future, end_event)
            if fate == "refused":
                handle.refused = TransferError(f"injected fault: batch {batch_id} refused at issue")
            if self._record:
                self.submitted.append((plan, tuple(wait_for), handle))
            order.add(Batch(handle, copy_plan, order.follows(plan.direction, preds), fate,
                            gated=fate == "hang" or self._holding,
                            wait_for_ids=tuple(h.batch_id for h in wait_for)))  # fmt: skip
        return handle

    def close(self, timeout_s: float | None = None) -> None:
        """Close the inner engine (waiting up to ``timeout_s`` for copies in flight), complete
        delayed batches at once, then fail every batch whose copy never started with an error
        that is both a ``ClosedError`` and a ``TransferError`` (without an inner engine held
        batches complete instead: there is nothing to abort). Joins the delay thread.
        Idempotent.

        Raises:
            TransferError: whatever the inner engine's ``close`` raises (after the steps above).
            TransferTimeoutError: ``close_hangs`` and batches are still gated.
        """
        if self._closed:
            return
        self._closed = True
        self._order.closed = True
        try:
            if self.inner is not None:
                self.inner.close(timeout_s)  # a CUDA engine raises if copies outlive timeout_s
        finally:
            self._hooks.close()
            if self._close_hangs:
                self._order.close(None)
            elif self.inner is None:
                self.release()
                self._order.close(None)
            else:
                self._order.close(closed_before_copy)
        if self._close_hangs and self._order.batches:
            num = len(self._order.batches)
            raise TransferTimeoutError(f"{num} batches still in flight after {timeout_s} s")

    def statistics(self) -> EngineStatistics:
        """Totals: the inner engine's, with injected failures counted and the outer in-flight
        (without an inner engine, this engine's own)."""
        with self._order.lock:
            in_flight = len(self._order.batches)
        if self.inner is None:
            totals = attrs.asdict(self._totals)
            totals |= {"batches_submitted": self._next_batch_id, "in_flight": in_flight}
            return EngineStatistics(**totals, path=self.name)
        inner = self.inner.statistics()
        failed = inner.batches_failed + self._script.num_failed
        return attrs.evolve(inner, batches_failed=failed, in_flight=in_flight)

    def stream_wait(self, handle: BatchHandle, stream: Any = None) -> None:
        """Forward to the inner engine once the batch's copy started.

        Raises:
            TransferError: the batch is gated and the inner engine fences on a device stream.
        """
        self.stream_waits.append(handle.batch_id)
        if self.inner is None:
            return
        with self._order.lock:
            batch = self._order.by_id.get(handle.batch_id)
            inner = None if batch is None else batch.inner
            pending = batch is not None and batch.inner is None and not batch.resolved
        if inner is not None:
            self.inner.stream_wait(inner, stream)
        elif pending and type(self.inner).stream_wait is not TransferEngine.stream_wait:
            raise TransferError(f"batch {handle.batch_id} is held; its copy has not started")

    # ------------------------------------------------------------------ internals

    def _start(self, batch: Batch, waits: Sequence[BatchHandle]) -> None:
        """Hand one batch's copy to the inner engine (``BatchOrder``'s ``start``)."""
        if batch.fate == "refused":  # its issue was refused: nothing runs, the batch fails
            batch.outcome = batch.handle.refused
            self._order.resolve_ready()
            return
        if self.inner is None:  # nothing to copy: the copy ends now
            self._finish(batch, None)
            return
        try:
            batch.inner = self.inner.submit(batch.plan, wait_for=waits)
        except TransferError as exc:  # the inner engine refused: the batch fails
            batch.outcome = exc
            self._order.resolve_ready()
            return
        batch.inner.future.add_done_callback(functools.partial(self._finish, batch))

    def _finish(self, batch: Batch, future: concurrent.futures.Future[BatchResult] | None) -> None:
        """The copy ended (any thread): poison a failed store, count, then resolve or delay."""
        exc = None if future is None else future.exception()
        if exc is None and batch.fate == "fail" and future is not None:
            self._script.poison_store(batch.plan)
        outcome: BatchResult | BaseException
        if exc is not None:
            outcome = exc
        elif batch.fate == "fail":
            outcome = TransferError(f"injected fault: batch {batch.handle.batch_id} failed")
        elif future is not None:
            outcome = future.result()
        else:
            outcome = no_copy_result(batch.handle.batch_id, batch.plan, self.name)
        if future is None:
            with self._order.lock:
                count_batch(self._totals, batch.plan, ok=not isinstance(outcome, BaseException))
        self._order.finish(batch, outcome)
