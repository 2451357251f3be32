"""What users need to test their own serving loops against kvmgr: faults, fake time, invariants.

Offers:
    FaultyEngine      wraps any engine; fails, delays, hangs or holds chosen batches, seeded
    VirtualClock      monotonic fake time for an asyncio loop, advanced only by the test
    check_invariants  raises ``InvariantError`` naming every broken manager invariant
    InvariantError    the ``AssertionError`` that ``check_invariants`` raises
    POISON_BYTE       what ``FaultyEngine`` writes over the CPU blocks of a failed store

Typical use (see docs/reliability.md)::

    engine = FaultyEngine(HostEngine(), fail_batches={1}, seed=0)
    async with OffloadManager(kv_caches, config, engine=engine) as mgr:
        ...                       # drive the manager as the serving loop does
        check_invariants(mgr)     # after every step of the test
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import heapq
import random
import threading
import time
from collections.abc import Collection, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np
import torch

from kvmgr.errors import ClosedError, ConfigError, TransferError
from kvmgr.pool.allocator import _ALLOCATED, BlockAllocator
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.plan import Direction, TransferPlan

if TYPE_CHECKING:
    from kvmgr.manager import OffloadManager

__all__ = ["POISON_BYTE", "FaultyEngine", "InvariantError", "VirtualClock", "check_invariants"]

T = TypeVar("T")

#: Byte written over every destination page of a failed store (GPU -> CPU) after its copy ran,
#: so a manager that treated the store as complete would serve this instead of the KV.
POISON_BYTE = 0xA5


class _ClosedBeforeCopy(ClosedError, TransferError):
    """The engine closed before this batch's copy started: nothing was copied."""


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
        fail_batches, hang_batches, refuse_batches: batch numbers to fail, hang, refuse.
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
            Whatever the inner engine's ``close`` raises (after the steps above).
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
                        rec.outcome = _ClosedBeforeCopy(f"engine closed before batch {batch_id}")
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
            except Exception as exc:  # the inner engine refused: the batch fails, nothing copied
                rec.outcome = exc if isinstance(exc, TransferError) else TransferError(str(exc))
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
            ValueError: ``seconds`` is negative (time is monotonic).
        """
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


class InvariantError(AssertionError):
    """A manager invariant does not hold; the message lists every violation found."""


def check_invariants(manager: OffloadManager, *, scan_poison: bool = True) -> None:
    """Check the manager's bookkeeping against itself; call it between steps of a test.

    Checked (each violation is named in the error, with the offending keys or block ids):

    - CPU tier: every allocated CPU block has exactly one owner (a keyed entry, a swapped-out
      request, or a preempt in flight) and no owner holds a free block (no leak, no double use);
    - index and policy track the same keys;
    - a key is PENDING exactly while one queued or in-flight store writes its block, and its
      reader count equals the loads of it queued or in flight (nothing pinned for ever);
    - every moving block table has its preempt or resume queued or in flight;
    - owned GPU pool: every allocated block belongs to a resident request, to a resume in
      flight, or to a copy not yet settled; no GPU block that a queued or in-flight copy reads
      or writes is free (it could be handed out while the DMA still uses it); no block is in two
      tables;
    - no swap future resolved before its copy settled (cancelled ones excepted);
    - ``statistics()`` counts match the queue, and with a ``FaultyEngine``: every unresolved
      batch belongs to the manager, and two unresolved batches of opposite directions that share
      a GPU block are ordered by ``wait_for``;
    - with a ``FaultyEngine`` and ``scan_poison``: no READY key's pages are all ``POISON_BYTE``
      (a failed store treated as complete). Costs one read of every READY page.

    Args:
        manager: an ``OffloadManager`` (open or closed).
        scan_poison: scan READY pages for the poison of failed stores.

    Raises:
        InvariantError: one or more invariants are broken.
    """
    problems: list[str] = []
    queued, in_flight = _unsettled_ops(manager)
    ops = queued + in_flight
    problems += _check_keys(manager, ops)
    problems += _check_cpu_owners(manager, ops)
    problems += _check_gpu_pool(manager, ops)
    for op in ops:
        if op.future.done() and not op.future.cancelled():
            problems.append(
                f"a {op.direction.value} swap's future resolved before its copy settled"
            )
    stats = manager.statistics()
    if stats.batches_in_flight != len(manager._queue.in_flight):
        problems.append(
            f"statistics: {stats.batches_in_flight} batches in flight, queue has "
            f"{len(manager._queue.in_flight)}"
        )
    if stats.queued_swaps != len(queued):
        problems.append(f"statistics: {stats.queued_swaps} queued swaps, queue has {len(queued)}")
    if stats.cpu_blocks_used != manager.cpu_blocks.num_allocated:
        problems.append("statistics: cpu_blocks_used differs from the allocator")
    if isinstance(manager.engine, FaultyEngine):
        problems += _check_engine(manager, manager.engine, scan_poison)
    if problems:
        raise InvariantError("kvmgr invariants broken:\n- " + "\n- ".join(problems))


def _short(key: bytes) -> str:
    return key.hex()[:16]


def _ints(ids: Any) -> list[int]:
    return [int(b) for b in ids]


def _allocated(pool: BlockAllocator) -> set[int]:
    return set(np.flatnonzero(pool._state == _ALLOCATED).tolist())


def _unsettled_ops(manager: OffloadManager) -> tuple[list[Any], list[Any]]:
    """The manager's swaps not settled yet: (queued, in flight), in order."""
    queue = manager._queue
    queued = [op for g in queue.generations for lane in g.lanes.values() for op in lane.ops]
    return queued, [op for batch in queue.in_flight for op in batch.ops]


def _check_keys(manager: OffloadManager, ops: list[Any]) -> list[str]:
    """Index vs policy; PENDING vs stores in flight; readers vs loads in flight."""
    problems: list[str] = []
    index, policy = manager.index, manager.policy
    entries = {key: index.entry(key) for key in index}
    missing = [_short(k) for k in entries if k not in policy]
    if missing or len(policy) != len(entries):
        problems.append(
            f"index has {len(entries)} keys, policy {len(policy)}; not in the policy: {missing[:8]}"
        )
    block_to_key = {e.block_id: k for k, e in entries.items()}
    if len(block_to_key) != len(entries):
        problems.append("two keys share one CPU block")
    writes: dict[int, int] = {}
    reads: dict[int, int] = {}
    for op in ops:
        target, ids = (writes, op.dst_ids) if op.direction is Direction.D2H else (reads, op.src_ids)
        for b in _ints(ids):
            target[b] = target.get(b, 0) + 1
    for key, entry in entries.items():
        pending = entry.state.value == "pending"
        n_writes, n_reads = writes.get(entry.block_id, 0), reads.get(entry.block_id, 0)
        if pending and n_writes != 1:
            problems.append(f"key {_short(key)} is PENDING with {n_writes} stores in flight")
        if not pending and n_writes:
            problems.append(f"key {_short(key)} is READY while a store still writes its block")
        if entry.readers != n_reads:
            problems.append(f"key {_short(key)} has {entry.readers} readers, {n_reads} loads")
    return problems


def _check_cpu_owners(manager: OffloadManager, ops: list[Any]) -> list[str]:
    """Every allocated CPU block has one owner; moving tables have their op."""
    problems: list[str] = []
    owners: dict[int, list[str]] = {}
    for key in manager.index:
        owners.setdefault(manager.index.entry(key).block_id, []).append(f"key {_short(key)}")
    keyed = set(owners)
    moving = 0
    for req_id, table in manager._tables.items():
        moving += table.moving
        if table.tier.value == "cpu":
            for b in table.block_ids:
                owners.setdefault(b, []).append(f"request {req_id!r}")
    num_moves = 0
    for op in ops:
        ids = op.dst_ids if op.direction is Direction.D2H else op.src_ids
        unkeyed = [b for b in _ints(ids) if b not in keyed]
        if unkeyed and len(unkeyed) != len(ids):
            problems.append(f"a {op.direction.value} swap mixes keyed and request CPU blocks")
        if unkeyed:
            num_moves += 1
        if unkeyed and op.direction is Direction.D2H:
            for b in unkeyed:
                owners.setdefault(b, []).append("a preempt in flight")
    if moving != num_moves:
        problems.append(f"{moving} block tables are moving, {num_moves} preempts/resumes queued")
    allocated = _allocated(manager.cpu_blocks)
    shared = {b: who for b, who in owners.items() if len(who) > 1}
    if shared:
        problems.append(f"CPU blocks with several owners: {dict(list(shared.items())[:8])}")
    leaked = sorted(allocated - set(owners))
    if leaked:
        problems.append(f"CPU blocks allocated with no owner (leaked): {leaked[:16]}")
    free_owned = sorted(set(owners) - allocated)
    if free_owned:
        problems.append(f"CPU blocks in use but free in the allocator: {free_owned[:16]}")
    return problems


def _check_gpu_pool(manager: OffloadManager, ops: list[Any]) -> list[str]:
    """Owned GPU pool: no leak, no block in two tables, no free block under a copy."""
    pool = manager.gpu_blocks
    if pool is None:
        return []
    problems: list[str] = []
    in_tables: dict[int, object] = {}
    for req_id, table in manager._tables.items():
        if table.tier.value != "gpu" or not table.gpu_owned:
            continue
        for b in table.block_ids:
            if b in in_tables:
                problems.append(
                    f"GPU block {b} is in the tables of {in_tables[b]!r} and {req_id!r}"
                )
            in_tables[b] = req_id
    under_copy: set[int] = set()
    for op in ops:
        under_copy.update(_ints(op.gpu_ids))
    free_in_table = sorted(b for b in in_tables if not pool.is_allocated(b))
    if free_in_table:
        problems.append(f"GPU blocks free in the owned pool but in a block table: {free_in_table}")
    free_under_copy = sorted(b for b in under_copy if not pool.is_allocated(b))
    if free_under_copy:
        problems.append(
            f"GPU blocks free in the owned pool while a queued or in-flight copy reads "
            f"or writes them (could be handed out mid-copy): {free_under_copy[:16]}"
        )
    allocated = _allocated(pool)
    leaked = sorted(allocated - set(in_tables) - under_copy)
    if leaked:
        problems.append(f"GPU blocks allocated with no request and no copy (leaked): {leaked[:16]}")
    return problems


def _check_engine(manager: OffloadManager, engine: FaultyEngine, scan_poison: bool) -> list[str]:
    """Unresolved batches belong to the manager and are fenced; no poisoned READY page."""
    problems: list[str] = []
    batches = [(b, h.batch_id) for b in manager._queue.in_flight if (h := b.handle) is not None]
    with engine._lock:
        unresolved = [rec.handle.batch_id for rec in engine._records]
    stray = sorted(set(unresolved) - {batch_id for _, batch_id in batches})
    if stray:
        problems.append(f"engine batches {stray} are unresolved but unknown to the manager")
    waits = {batch_id: engine.unresolved_wait_for(batch_id) for _, batch_id in batches}
    for i, (later, later_id) in enumerate(batches):
        later_waits = waits[later_id]
        if later_waits is None:
            continue  # its copy has ended
        for earlier, earlier_id in batches[:i]:
            if earlier.direction is later.direction or waits[earlier_id] is None:
                continue
            shared = set(_ints(earlier.gpu_ids)) & set(_ints(later.gpu_ids))
            if shared and earlier_id not in later_waits:
                problems.append(
                    f"batches {earlier_id} and {later_id} share GPU blocks "
                    f"{sorted(shared)[:8]} without a wait_for fence"
                )
    if scan_poison and engine._poison:
        ready = [(k, manager.index.entry(k).block_id) for k in manager.index]
        ready = [(k, b) for k, b in ready if manager.index.is_ready(k)]
        if ready:
            block_ids = torch.tensor([b for _, b in ready], dtype=torch.long)
            poisoned = torch.ones(len(ready), dtype=torch.bool)
            for pages in manager.cpu_pool.tensors:
                poisoned &= (pages[block_ids] == POISON_BYTE).all(dim=1)
            bad = [_short(ready[i][0]) for i in torch.nonzero(poisoned).flatten().tolist()]
            if bad:
                problems.append(f"READY keys hold the poison of a failed store: {bad[:8]}")
    return problems
