"""Fault injection for tests of serving loops: an engine that lies, one that does no copy.

Offers:
    FaultyEngine   wraps any engine; fails, delays, hangs or holds chosen batches, seeded
    NullEngine     copies nothing; completes every batch at once, or when the test says
    POISON_BYTE    what ``FaultyEngine`` writes over the CPU blocks of a failed store
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import heapq
import random
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import torch

from kvmgr.errors import ClosedBeforeCopyError, ClosedError, ConfigError, TransferError
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["POISON_BYTE", "FaultyEngine", "NullEngine"]

#: Byte written over every destination page of a failed store (GPU -> CPU) after its copy ran,
#: so a manager that treated the store as complete would serve this instead of the KV.
POISON_BYTE = 0xA5


@attrs.define(eq=False)
class _Record:
    """One batch submitted to the ``FaultyEngine``: its outer handle and where it stands."""

    handle: BatchHandle
    plan: TransferPlan
    preds: list[_Record]  # previous batch of the same direction + the wait_for batches
    fate: str  # "ok", "fail" or "hang"
    gated: bool  # held or hung: the copy waits for complete_next() / release()
    wait_for_ids: tuple[int, ...] = ()  # batch ids the manager asked to wait for
    inner: BatchHandle | None = None  # set once the copy was handed to the inner engine
    outcome: BatchResult | BaseException | None = None  # the inner copy's result
    resolved: bool = False  # the outer future is done

    @property
    def started(self) -> bool:
        return self.inner is not None or self.outcome is not None or self.resolved


class FaultyEngine(TransferEngine):
    """A ``TransferEngine`` that runs every copy on ``inner`` and lies about some of them.

    Batches are numbered ``0, 1, 2, ...`` in the order ``submit`` is called. Batch ``k``:

    - in ``refuse_batches``: ``submit`` raises ``TransferError`` (nothing is copied);
    - in ``hang_batches``: its copy does not start until ``complete_next``, ``release`` or
      ``close`` (the outer future stays pending: a completion that never arrives);
    - in ``fail_batches``, or drawn with probability ``fail_rate`` from ``random.Random(seed)``
      (one draw per batch): the copy runs, then the batch fails with ``TransferError``. A failed
      store's destination CPU pages are overwritten with ``POISON_BYTE`` (when ``poison``), so a
      manager that marked them READY would serve poison;
    - otherwise it completes, ``delay_s`` seconds after the inner copy ended.

    Order is kept as a real stream keeps it: a batch's copy starts only after the copies of the
    previous batch of its direction and of its ``wait_for`` batches were handed to ``inner``
    (so a hung batch stalls its direction), and outer futures resolve in that order too.

    ``hold()`` gates every later batch the same way as a hung one; ``complete_next(n)`` then
    starts the ``n`` oldest gated batches, ``release()`` all of them. The copy runs on the inner
    engine, so the outer future resolves (on an engine thread) shortly after; await the
    manager's future to observe it.

    Args:
        inner: the engine that really copies (closed by ``close``).
        fail_batches: batch numbers to fail.
        hang_batches: batch numbers to hang.
        refuse_batches: batch numbers to refuse at submit.
        fail_rate: probability in ``[0, 1]`` that any other batch fails.
        delay_s: seconds between the inner copy's end and the outer completion (real time;
            waited on a worker thread started on first use and joined by ``close``).
        seed: seed of the failure draws.
        poison: overwrite the destination of failed stores with ``POISON_BYTE``.
        fail_directions: directions ``fail_rate`` applies to (for example only
            ``Direction.D2H``, for a caller that cannot survive a failed load).

    Raises:
        ConfigError: ``fail_rate`` outside ``[0, 1]``, negative ``delay_s``, or ``inner`` is not
            a ``TransferEngine``.
    """

    def __init__(
        self,
        inner: TransferEngine,
        *,
        fail_batches: Collection[int] = (),
        fail_rate: float = 0.0,
        delay_s: float = 0.0,
        hang_batches: Collection[int] = (),
        refuse_batches: Collection[int] = (),
        seed: int = 0,
        poison: bool = True,
        fail_directions: Collection[Direction] = (Direction.D2H, Direction.H2D),
    ) -> None:
        if not isinstance(inner, TransferEngine):
            raise ConfigError(f"expected a TransferEngine, got {type(inner).__name__}")
        if not 0.0 <= fail_rate <= 1.0:
            raise ConfigError(f"fail_rate: expected a probability in [0, 1], got {fail_rate!r}")
        if not delay_s >= 0.0:
            raise ConfigError(f"delay_s: expected seconds >= 0, got {delay_s!r}")
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.max_descriptors = inner.max_descriptors
        self._fail_batches = frozenset(fail_batches)
        self._hang_batches = frozenset(hang_batches)
        self._refuse_batches = frozenset(refuse_batches)
        self._fail_rate = fail_rate
        self._fail_directions = frozenset(fail_directions)
        self._delay_s = delay_s
        self._poison = poison
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._records: list[_Record] = []  # unresolved, in submission order
        self._by_id: dict[int, _Record] = {}  # unresolved, by outer batch id
        self._last: dict[Direction, _Record | None] = {Direction.D2H: None, Direction.H2D: None}
        self._delayed: list[tuple[float, int, _Record]] = []  # heap of (due, batch id, record)
        self._worker: threading.Thread | None = None
        self._next_batch_id = 0
        self._holding = False
        self._closed = False
        self.injected: dict[int, str] = {}  #: batch id -> "fail", "hang" or "refuse"

    # ------------------------------------------------------------------ engine protocol

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """The inner engine's host allocation."""
        return self.inner.allocate_host(num_bytes)

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Number the batch, decide its fate, and start its copy when its order allows.

        Raises:
            ClosedError: the engine is closed.
            TransferError: the batch is in ``refuse_batches``, or a ``wait_for`` handle was not
                returned by this engine.
        """
        if self._closed:
            raise ClosedError("faulty engine is closed")
        with self._lock:
            preds = [self._by_id.get(h.batch_id) for h in wait_for]
            for handle, pred in zip(wait_for, preds):
                if pred is not None and pred.handle is not handle:
                    raise TransferError(f"wait_for batch {handle.batch_id} is not from this engine")
            batch_id = self._next_batch_id
            self._next_batch_id += 1
            failed_draw = self._rng.random() < self._fail_rate  # drawn for every batch
            failed_draw &= plan.direction in self._fail_directions
            if batch_id in self._refuse_batches:
                self.injected[batch_id] = "refuse"
                raise TransferError(f"injected fault: batch {batch_id} refused at submit")
            fate = "hang" if batch_id in self._hang_batches else "ok"
            if fate == "ok" and (batch_id in self._fail_batches or failed_draw):
                fate = "fail"
            if fate != "ok":
                self.injected[batch_id] = fate
            future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
            future.set_running_or_notify_cancel()  # like an executor's: cannot be cancelled
            handle = BatchHandle(batch_id, plan.direction, future)
            last = self._last[plan.direction]
            rec = _Record(
                handle,
                plan,
                [p for p in [last, *preds] if p is not None],
                fate,
                gated=fate == "hang" or self._holding,
                wait_for_ids=tuple(h.batch_id for h in wait_for),
            )
            self._records.append(rec)
            self._by_id[batch_id] = rec
            self._last[plan.direction] = rec
            self._start_ready()
        return handle

    def close(self, timeout_s: float | None = None) -> None:
        """Close the inner engine (waiting up to ``timeout_s`` for copies in flight), complete
        delayed batches at once, then fail every batch whose copy never started with an error
        that is both a ``ClosedError`` and a ``TransferError``. Joins the delay thread.
        Idempotent.

        Raises:
            TransferError: whatever the inner engine's ``close`` raises (after the steps above).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.inner.close(timeout_s)  # a CUDA engine raises if copies outlive timeout_s
        finally:
            with self._lock:
                worker, self._worker = self._worker, None
                self._wake.notify_all()
            if worker is not None:
                worker.join()
            with self._lock:
                self._delayed.clear()  # their copies are done: complete them now
                for rec in list(self._records):
                    if not rec.started:
                        batch_id = rec.handle.batch_id
                        rec.outcome = ClosedBeforeCopyError(
                            f"engine closed before batch {batch_id}"
                        )
                self._resolve_ready()

    def statistics(self) -> EngineStatistics:
        """The inner engine's totals, with injected failures counted and the outer in-flight."""
        inner = self.inner.statistics()
        failed = sum(1 for fate in self.injected.values() if fate == "fail")
        with self._lock:
            in_flight = len(self._records)
        return attrs.evolve(
            inner, batches_failed=inner.batches_failed + failed, in_flight=in_flight
        )

    def stream_wait(self, handle: BatchHandle, stream: Any = None) -> None:
        """Forward to the inner engine once the batch's copy started.

        Raises:
            TransferError: the batch is gated and the inner engine fences on a device stream.
        """
        with self._lock:
            rec = self._by_id.get(handle.batch_id)
            inner = None if rec is None else rec.inner
            pending = rec is not None and rec.inner is None and not rec.resolved
        if inner is not None:
            self.inner.stream_wait(inner, stream)
        elif pending and type(self.inner).stream_wait is not TransferEngine.stream_wait:
            raise TransferError(f"batch {handle.batch_id} is held; its copy has not started")

    # ------------------------------------------------------------------ test controls

    def hold(self) -> None:
        """Gate every batch submitted from now on until ``complete_next`` or ``release``."""
        self._holding = True

    def complete_next(self, n: int = 1, *, fail: bool = False) -> list[BatchHandle]:
        """Start the copies of the ``n`` oldest gated batches (held or hung); with ``fail``,
        those batches fail after their copy. Returns their handles (fewer if fewer wait).

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"expected n >= 0, got {n}")
        with self._lock:
            chosen = [rec for rec in self._records if rec.gated and not rec.resolved][:n]
            for rec in chosen:
                rec.gated = False
                if fail:
                    rec.fate = "fail"
                    self.injected[rec.handle.batch_id] = "fail"
            self._start_ready()
        return [rec.handle for rec in chosen]

    def release(self) -> list[BatchHandle]:
        """Stop holding and start every gated batch, hung ones included. Returns their handles."""
        self._holding = False
        return self.complete_next(len(self._records))

    @property
    def waiting_batch_ids(self) -> list[int]:
        """Batches whose copy has not started (gated, or behind a gated batch), oldest first."""
        with self._lock:
            return [rec.handle.batch_id for rec in self._records if not rec.started]

    def unresolved_wait_for(self, batch_id: int) -> tuple[int, ...] | None:
        """The ``wait_for`` batch ids given with an unresolved batch; ``None`` once it resolved."""
        with self._lock:
            rec = self._by_id.get(batch_id)
            return None if rec is None else rec.wait_for_ids

    @property
    def unresolved_batch_ids(self) -> list[int]:
        """Batches submitted and not resolved yet, oldest first."""
        with self._lock:
            return [rec.handle.batch_id for rec in self._records]

    @property
    def poisons(self) -> bool:
        """Whether failed stores' destination pages are overwritten with ``POISON_BYTE``."""
        return self._poison

    @property
    def num_submitted(self) -> int:
        """Calls to ``submit`` so far (refused ones included)."""
        return self._next_batch_id

    # ------------------------------------------------------------------ internals

    def _start_ready(self) -> None:
        """Hand to ``inner``, in order, every ungated batch whose predecessors have started."""
        for rec in list(self._records):  # resolving may shrink the list
            if rec.started or rec.gated or not all(p.started for p in rec.preds):
                continue
            waits = [p.inner for p in rec.preds if p.inner is not None and not p.resolved]
            try:
                rec.inner = self.inner.submit(rec.plan, wait_for=waits)
            except TransferError as exc:  # the inner engine refused: the batch fails
                rec.outcome = exc
                self._resolve_ready()
                continue
            rec.inner.future.add_done_callback(functools.partial(self._on_copied, rec))

    def _on_copied(self, rec: _Record, future: concurrent.futures.Future[BatchResult]) -> None:
        """Inner completion (any thread): poison a failed store, then resolve or delay."""
        exc = future.exception()
        store = rec.plan.direction is Direction.D2H  # its destination is host memory
        if exc is None and rec.fate == "fail" and self._poison and store:
            for addr, size in zip(rec.plan.dst_addrs.tolist(), rec.plan.sizes.tolist()):
                ctypes.memset(addr, POISON_BYTE, size)
        with self._lock:
            if exc is not None:
                rec.outcome = exc
            elif rec.fate == "fail":
                rec.outcome = TransferError(f"injected fault: batch {rec.handle.batch_id} failed")
            else:
                rec.outcome = future.result()
            if self._delay_s > 0 and not self._closed:
                due = time.monotonic() + self._delay_s
                heapq.heappush(self._delayed, (due, rec.handle.batch_id, rec))
                self._ensure_worker()
                self._wake.notify_all()
            else:
                self._resolve_ready()

    def _resolve_ready(self) -> None:
        """Resolve, in submission order, every batch whose outcome is known, whose delay has
        passed and whose predecessors are resolved. Caller holds the lock."""
        delayed = {id(rec) for _, _, rec in self._delayed}
        for rec in list(self._records):
            if rec.outcome is None or id(rec) in delayed:
                continue
            if not all(p.resolved for p in rec.preds):
                continue
            rec.resolved = True
            rec.preds = []  # cut the chain to older records
            self._records.remove(rec)
            del self._by_id[rec.handle.batch_id]
            if isinstance(rec.outcome, BaseException):
                rec.handle.future.set_exception(rec.outcome)
            else:
                rec.handle.future.set_result(rec.outcome)

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run_delays, name="kvmgr-faulty-delay", daemon=True
            )
            self._worker.start()

    def _run_delays(self) -> None:
        with self._lock:
            while self._worker is threading.current_thread():
                now = time.monotonic()
                if self._delayed and self._delayed[0][0] <= now:
                    heapq.heappop(self._delayed)
                    self._resolve_ready()
                    continue
                timeout = self._delayed[0][0] - now if self._delayed else None
                self._wake.wait(timeout)


class NullEngine(TransferEngine):
    """A ``TransferEngine`` that copies nothing: for host-path benchmarks and for tests of the
    bookkeeping alone.

    Every batch completes at once (its future is resolved inside ``submit``), or, with
    ``hold=True``, only when ``complete_next`` or ``release`` says so (in submission order).
    ``allocate_host`` returns an uninitialised CPU tensor (no page is touched).

    Args:
        hold: keep every batch pending until told.
    """

    name = "null"

    def __init__(self, *, hold: bool = False) -> None:
        self._hold = hold
        self._pending: list[tuple[BatchHandle, int]] = []
        self._next_batch_id = 0
        self._closed = False
        self._completed = 0
        self._failed = 0
        self._bytes = {Direction.D2H: 0, Direction.H2D: 0}

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """An uninitialised ``uint8`` CPU tensor of ``num_bytes``."""
        return torch.empty(num_bytes, dtype=torch.uint8)

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Resolve the batch now (or queue it when holding).

        Raises:
            ClosedError: the engine is closed.
        """
        if self._closed:
            raise ClosedError("null engine is closed")
        del wait_for  # batches complete in submission order, which honours every fence
        future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
        handle = BatchHandle(self._next_batch_id, plan.direction, future)
        self._next_batch_id += 1
        num_bytes = int(plan.sizes.sum()) if len(plan.sizes) else 0
        if self._hold:
            self._pending.append((handle, num_bytes))
        else:
            self._resolve(handle, num_bytes, fail=False)
        return handle

    def _resolve(self, handle: BatchHandle, num_bytes: int, *, fail: bool) -> None:
        if fail:
            self._failed += 1
            handle.future.set_exception(
                TransferError(f"null engine: batch {handle.batch_id} failed")
            )
            return
        self._completed += 1
        self._bytes[handle.direction] += num_bytes
        handle.future.set_result(
            BatchResult(
                batch_id=handle.batch_id,
                direction=handle.direction,
                num_bytes=num_bytes,
                num_descriptors=0,
                device_s=None,
                path="null",
            )
        )

    def complete_next(self, n: int = 1, *, fail: bool = False) -> int:
        """Resolve the ``n`` oldest pending batches (failed with ``TransferError`` when
        ``fail``). Returns how many were resolved."""
        chosen, self._pending = self._pending[:n], self._pending[n:]
        for handle, num_bytes in chosen:
            self._resolve(handle, num_bytes, fail=fail)
        return len(chosen)

    def release(self) -> int:
        """Stop holding and resolve every pending batch."""
        self._hold = False
        return self.complete_next(len(self._pending))

    @property
    def num_pending(self) -> int:
        """Batches held and not resolved."""
        return len(self._pending)

    def close(self, timeout_s: float | None = None) -> None:
        """Resolve what is pending, then refuse new batches. Idempotent."""
        del timeout_s
        if not self._closed:
            self.release()
            self._closed = True

    def statistics(self) -> EngineStatistics:
        """Totals since creation."""
        return EngineStatistics(
            batches_submitted=self._next_batch_id,
            batches_completed=self._completed,
            batches_failed=self._failed,
            bytes_d2h=self._bytes[Direction.D2H],
            bytes_h2d=self._bytes[Direction.H2D],
            in_flight=len(self._pending),
            path="null",
        )
