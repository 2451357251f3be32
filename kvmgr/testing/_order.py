"""The batches of one ``ScriptedEngine``, kept in the order a real stream keeps them.

Private to ``kvmgr.testing``. Offers:
    Batch         one submitted batch: its outer handle, plan, fate and where it stands
    BatchOrder    starts each batch's copy once the batches it follows have started, and
                  resolves the outer futures in that order, after an optional real-time delay
                  (waited on one worker thread, started on first use)

A batch follows the previous batch of its direction and its ``wait_for`` batches. Every method
that touches the batches takes ``BatchOrder.lock`` (re-entrant: a copy that completes at once
resolves inside ``start_ready``).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from kvmgr.errors import ClosedBeforeCopyError, ConfigError
from kvmgr.transfer.engine import BatchHandle, BatchResult
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["Batch", "BatchOrder", "closed_before_copy"]


@attrs.define(eq=False)
class Batch:
    """One batch submitted to a ``ScriptedEngine``."""

    handle: BatchHandle
    plan: TransferPlan  # the plan the copy runs (an ``on_submit`` hook may have replaced it)
    preds: list[Batch]  # previous batch of the same direction + the wait_for batches
    fate: str  # "ok", "fail" or "hang"
    gated: bool  # held or hung: the copy waits for complete_next() / release()
    wait_for_ids: tuple[int, ...] = ()  # batch ids the caller asked to wait for
    inner: BatchHandle | None = None  # set once the copy was handed to the inner engine
    outcome: BatchResult | BaseException | None = None  # the copy's result
    resolved: bool = False  # the outer future is done

    @property
    def started(self) -> bool:
        """Whether the copy was handed on (or needed none)."""
        return self.inner is not None or self.outcome is not None or self.resolved


class BatchOrder:
    """Unresolved batches in submission order.

    Args:
        start: starts one batch's copy (``Batch`` and the inner handles it must wait for); it
            sets ``batch.inner`` or, for a copy that ends at once, calls ``finish``.
        delay_s: real seconds between a copy's end and its batch's resolution.

    Raises:
        ConfigError: negative ``delay_s``.
    """

    def __init__(self, start: Callable[[Batch, Sequence[BatchHandle]], None], delay_s: float):
        if not delay_s >= 0.0:
            raise ConfigError(f"delay_s: expected seconds >= 0, got {delay_s!r}")
        self._start = start
        self._delay_s = delay_s
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self.batches: list[Batch] = []  # unresolved, in submission order
        self.by_id: dict[int, Batch] = {}  # unresolved, by outer batch id
        self._last: dict[Direction, Batch | None] = {Direction.D2H: None, Direction.H2D: None}
        self._delayed: list[tuple[float, int, Batch]] = []  # heap of (due, batch id, batch)
        self._worker: threading.Thread | None = None
        self.closed = False  # set by the engine's close: no more delays

    def follows(self, direction: Direction, wait_for: Sequence[Batch | None]) -> list[Batch]:
        """The batches a new batch of ``direction`` follows. Caller holds the lock."""
        return [p for p in [self._last[direction], *wait_for] if p is not None]

    def add(self, batch: Batch) -> None:
        """Append a new batch and start what may start."""
        with self.lock:
            self.batches.append(batch)
            self.by_id[batch.handle.batch_id] = batch
            self._last[batch.plan.direction] = batch
            self.start_ready()

    def start_ready(self) -> None:
        """Start, in order, every ungated batch whose predecessors have started."""
        with self.lock:
            for batch in list(self.batches):  # resolving may shrink the list
                if batch.started or batch.gated or not all(p.started for p in batch.preds):
                    continue
                waits = [p.inner for p in batch.preds if p.inner is not None and not p.resolved]
                self._start(batch, waits)

    def finish(self, batch: Batch, outcome: BatchResult | BaseException) -> None:
        """The copy ended (any thread): resolve now, or after the delay."""
        with self.lock:
            batch.outcome = outcome
            if self._delay_s > 0 and not self.closed:
                due = time.monotonic() + self._delay_s
                heapq.heappush(self._delayed, (due, batch.handle.batch_id, batch))
                self._ensure_worker()
                self._wake.notify_all()
            else:
                self.resolve_ready()

    def resolve_ready(self) -> None:
        """Resolve, in submission order, every batch whose outcome is known, whose delay has
        passed and whose predecessors are resolved."""
        with self.lock:
            delayed = {id(batch) for _, _, batch in self._delayed}
            for batch in list(self.batches):
                if batch.outcome is None or id(batch) in delayed:
                    continue
                if not all(p.resolved for p in batch.preds):
                    continue
                batch.resolved = True
                batch.preds = []  # cut the chain to older batches
                self.batches.remove(batch)
                del self.by_id[batch.handle.batch_id]
                if isinstance(batch.outcome, BaseException):
                    batch.handle.future.set_exception(batch.outcome)
                else:
                    batch.handle.future.set_result(batch.outcome)

    def close(self, unstarted: Callable[[Batch], BatchResult | BaseException] | None) -> None:
        """Join the delay thread, resolve delayed batches at once, and give every batch whose
        copy never started the outcome ``unstarted(batch)`` (``None``: leave them pending)."""
        with self.lock:
            self.closed = True
            worker, self._worker = self._worker, None
            self._wake.notify_all()
        if worker is not None:
            worker.join()
        with self.lock:
            self._delayed.clear()  # their copies are done: complete them now
            if unstarted is not None:
                for batch in self.batches:
                    if not batch.started:
                        batch.outcome = unstarted(batch)
            self.resolve_ready()

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run_delays, name="kvmgr-faulty-delay", daemon=True
            )
            self._worker.start()

    def _run_delays(self) -> None:
        with self.lock:
            while self._worker is threading.current_thread():
                now = time.monotonic()
                if self._delayed and self._delayed[0][0] <= now:
                    heapq.heappop(self._delayed)
                    self.resolve_ready()
                    continue
                timeout = self._delayed[0][0] - now if self._delayed else None
                self._wake.wait(timeout)


def closed_before_copy(batch: Batch) -> BaseException:
    """The outcome of a batch whose copy never started when its engine closed."""
    return ClosedBeforeCopyError(f"engine closed before batch {batch.handle.batch_id}")
