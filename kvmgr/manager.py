"""OffloadManager: the asyncio facade over the pools, the prefix index, the policy and an engine.

Offers:
    OffloadManager   lookup / swap_out / swap_in / preempt / resume / step, as docs/architecture.md draws it

Swaps only queue work and return an ``asyncio.Future``; ``step()`` (or, with ``flush="tick"``,
the end of the event-loop tick) turns the queue into one plan per direction and submits it. The
engine reports completion from its own thread; the manager applies the bookkeeping on the loop
thread (``call_soon_threadsafe``) and then resolves the futures, in submission order.

Cancelling a task that awaits a swap's future cancels that future, never the copy: the copy
runs to its end and the bookkeeping (READY states, freed blocks, block tables) completes as if
nobody had cancelled. ``wait()`` shields the future, so cancelling it leaves the future intact.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from kvmgr import _queue
from kvmgr._manager_state import ManagerState
from kvmgr.config import ManagerConfig
from kvmgr.errors import (
    ClosedError,
    ConfigError,
    GeometryError,
    InvalidArgumentError,
    PoolExhaustedError,
    TransferError,
    TransferTimeoutError,
)
from kvmgr.hooks import HookReport, StepContext, StepHook
from kvmgr.pool.layout import KVLayout
from kvmgr.reports import DirectionReport, ManagerStatistics, StepReport
from kvmgr.transfer import make_engine
from kvmgr.transfer.engine import TransferEngine
from kvmgr.transfer.host import HostEngine
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan

__all__ = ["OffloadManager"]

#: Completed-batch results kept for the next ``StepReport`` (older ones are dropped, so a
#: caller that never calls ``step()``, e.g. with ``flush="tick"``, does not grow memory).
_MAX_COMPLETED = 4096


class OffloadManager(ManagerState):
    """Manages a KV cache across GPU memory and a CPU tier; embed one per serving loop.

    Args:
        gpu_kv_caches: the KV tensors, each with ``num_gpu_blocks`` as dim 0 and contiguous
            blocks (``[num_blocks, ...]``; viewed as ``[num_blocks, page_bytes]``). CUDA tensors
            for the CUDA engines, CPU tensors for the host engine. Not copied: kept alive here.
        config: settings; ``num_cpu_blocks`` is required.
        hooks: step hooks run in order by ``step()``.
        engine: an engine instance to use instead of ``config.engine`` (for example a
            ``kvmgr.testing.FaultyEngine``); the manager closes it on ``close()``.

    Raises:
        GeometryError: the tensors cannot be managed, or do not suit the engine's device.
        ConfigError: invalid settings.

    Use it as ``async with OffloadManager(...) as mgr:``, or call ``await mgr.aclose()``.
    Every public method validates its input and raises before changing any state.
    """

    def __init__(
        self,
        gpu_kv_caches: Sequence[torch.Tensor],
        config: ManagerConfig,
        *,
        hooks: Sequence[StepHook] = (),
        engine: TransferEngine | None = None,
    ) -> None:
        if not isinstance(config, ManagerConfig):
            raise ConfigError(f"expected a ManagerConfig, got {type(config).__name__}")
        gpu_layout = KVLayout.from_tensors(gpu_kv_caches)
        for hook in hooks:
            if not isinstance(hook, StepHook):
                raise ConfigError(f"expected a StepHook, got {type(hook).__name__}")
        if engine is None:
            engine = make_engine(config.engine, gpu_layout.device, config)
        elif isinstance(engine, HostEngine) and gpu_layout.device.type != "cpu":
            raise GeometryError(f"the host engine needs CPU tensors, got {gpu_layout.device}")
        self._gpu_kv_caches = list(gpu_kv_caches)
        self.engine = engine
        super().__init__(config, gpu_layout, engine.allocate_host)
        self._hooks = list(hooks)
        self._queue = _queue.SwapQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick_scheduled = False
        #: results of batches completed since the last step() (bounded when step() is unused)
        self._completed: collections.deque[Any] = collections.deque(maxlen=_MAX_COMPLETED)
        self._closing = False
        self._step = 0
        self._room_waiters: list[asyncio.Future[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> OffloadManager:
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether ``close``/``aclose`` has been called."""
        return self._closed

    async def aclose(self, timeout_s: float | None = 30.0) -> None:
        """Close: fail queued swaps with ``ClosedError``, wait (up to ``timeout_s`` seconds) for
        the copies in flight and apply their bookkeeping, then close the engine. Idempotent."""
        if self._closed:
            return
        self._closing = True  # from here on, new swaps raise ClosedError
        self._fail_room_waiters()
        pending = [b.handle.future for b in self._queue.in_flight if b.handle is not None]
        if pending:
            waits = [asyncio.wrap_future(f) for f in pending]
            for wait in waits:  # outcomes go to the swaps' futures: mark these retrieved
                wait.add_done_callback(lambda f: f.cancelled() or f.exception())
            await asyncio.wait(waits, timeout=timeout_s)
            await asyncio.sleep(0)  # let completion callbacks scheduled by the engine run
        self.close(timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Synchronous close: fail queued swaps, wait for the engine (bounded), then settle
        every in-flight batch here. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for generation in self._queue.take():
            for lane in generation.lanes.values():
                for op in lane.ops:
                    self._settle(op, ClosedError("manager closed before the swap was submitted"))
        try:
            self.engine.close(timeout_s)  # may raise TransferTimeoutError: copies still running
        finally:
            for batch in list(self._queue.in_flight):
                self._complete_batch(batch)
            self._fail_room_waiters()

    def _check_open(self) -> asyncio.AbstractEventLoop:
        if self._closed or self._closing:
            raise ClosedError("the manager is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and (self._queue.in_flight or len(self._queue)):
                raise InvalidArgumentError(
                    "the manager has swaps queued or in flight on another event loop; "
                    "use one manager per loop"
                )
            self._loop = loop  # rebind: nothing pending on the old loop
        return loop

    # ------------------------------------------------------------------ queueing

    def _enqueue(self, op: _queue.Op) -> None:
        self._queue.add(op)
        if self.config.flush == "tick" and not self._tick_scheduled:
            self._tick_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush_tick)

    def _flush_tick(self) -> None:
        self._tick_scheduled = False
        if not self._closed:
            self._flush()

    def _new_future(self) -> asyncio.Future[Any]:
        return self._check_open().create_future()

    # ------------------------------------------------------------------ backpressure

    def swap_out(
        self,
        gpu_block_ids: Sequence[int],
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
    ) -> asyncio.Future[Any]:
        """Queue a store; see ``ManagerState.swap_out``.

        With ``backpressure="wait"``, a store that finds no room does not raise at once: the
        returned future (a task) waits up to ``store_wait_s`` seconds for blocks to become
        evictable (a store or load completing, a request freed), then queues the store, or fails
        with ``PoolExhaustedError(reason="timeout")``. Bad input still raises at once.
        """
        try:
            return super().swap_out(gpu_block_ids, keys, parents)
        except PoolExhaustedError as exc:
            if self.config.backpressure != "wait" or exc.needed > self.cpu_blocks.num_blocks:
                self._rejected[exc.reason] += 1
                raise
        loop = self._check_open()
        deadline = loop.time() + self.config.store_wait_s
        return loop.create_task(
            self._swap_out_when_room(list(gpu_block_ids), list(keys), parents, deadline)
        )

    def preempt(self, req_id: Hashable) -> asyncio.Future[Any]:
        """Queue a request-level swap-out; see ``ManagerState.preempt``."""
        try:
            return super().preempt(req_id)
        except PoolExhaustedError as exc:
            self._rejected[exc.reason] += 1
            raise

    async def _swap_out_when_room(
        self,
        gpu_block_ids: list[int],
        keys: list[bytes],
        parents: Sequence[bytes | None] | None,
        deadline: float,
    ) -> Any:
        loop = self._check_open()
        while True:
            try:  # room may have appeared before this task first ran
                future = ManagerState.swap_out(self, gpu_block_ids, keys, parents)
            except PoolExhaustedError:
                pass
            else:
                return await future
            waiter: asyncio.Future[None] = loop.create_future()
            self._room_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                self._rejected["timeout"] += 1
                raise PoolExhaustedError(
                    f"cpu tier: no room for {len(keys)} blocks within {self.config.store_wait_s} s",
                    needed=len(keys),
                    available=self.cpu_blocks.num_free,
                    reason="timeout",
                ) from None
            finally:
                if waiter in self._room_waiters:
                    self._room_waiters.remove(waiter)

    def _fail_room_waiters(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(ClosedError("manager closed while the store waited for room"))

    def _wake_room_waiters(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def free(self, req_id: Hashable) -> None:
        """Drop the request's table and free its blocks; see ``ManagerState.free``."""
        super().free(req_id)
        self._wake_room_waiters()

    # ------------------------------------------------------------------ step and flush

    async def step(self, ctx: StepContext | None = None) -> StepReport:
        """Run the hooks in order on the compute stream, then submit everything queued since the
        last step as one plan per direction (more only when a hazard forces ordered batches).

        Args:
            ctx: what the scheduler knows about the step; ``None`` = an empty context.

        Returns:
            The step report: batches submitted, hooks, batches completed since the last step,
            host seconds spent here.

        Raises:
            ClosedError: the manager is closed.
            Whatever a hook raises (the queue is left untouched then).
        """
        self._check_open()
        if ctx is not None and not isinstance(ctx, StepContext):
            raise InvalidArgumentError(f"expected a StepContext or None, got {type(ctx).__name__}")
        start = time.perf_counter()
        step = self._step + 1
        if ctx is None:
            ctx = StepContext(step=step)
        hook_reports = tuple(hook(ctx) for hook in self._hooks)
        for hook, hook_report in zip(self._hooks, hook_reports):
            if not isinstance(hook_report, HookReport):
                raise InvalidArgumentError(
                    f"hook {getattr(hook, 'name', hook)!r} returned "
                    f"{type(hook_report).__name__}, expected a HookReport (is it async?)"
                )
        self._step = step
        d2h, h2d = self._flush()
        completed = tuple(self._completed)
        self._completed.clear()
        self._count_step()
        report = StepReport(
            step=self._step if ctx.step is None else ctx.step,
            d2h=d2h,
            h2d=h2d,
            hooks=hook_reports,
            completed=completed,
            host_s=time.perf_counter() - start,
        )
        await asyncio.sleep(0)
        return report

    def _flush(self) -> tuple[DirectionReport, DirectionReport]:
        reports = {Direction.D2H: DirectionReport(), Direction.H2D: DirectionReport()}
        for generation in self._queue.take():
            for direction, lane in generation.lanes.items():
                if not lane.ops:
                    continue
                src = np.array(lane.src_ids, dtype=np.int64)
                dst = np.array(lane.dst_ids, dtype=np.int64)
                if direction is Direction.D2H:
                    layouts, gpu_ids = (self.gpu_layout, self.cpu_pool.layout), src
                else:
                    layouts, gpu_ids = (self.cpu_pool.layout, self.gpu_layout), dst
                try:
                    plan = build_plan(direction, *layouts, src, dst, merge=self.config.merge)
                except Exception as exc:  # never orphan queued swaps: fail them, roll back
                    error = TransferError(f"could not plan the {direction.value} batch: {exc}")
                    for op in lane.ops:
                        self._settle(op, error)
                    self._wake_room_waiters()
                    continue
                self._submit(_queue.Batch(direction, lane.ops, gpu_ids), plan)
                reports[direction] = _queue.add_reports(
                    reports[direction], _queue.direction_report(len(lane.ops), plan)
                )
        return reports[Direction.D2H], reports[Direction.H2D]

    def _submit(self, batch: _queue.Batch, plan: TransferPlan) -> None:
        fences = self._queue.fences(batch)
        try:
            batch.handle = self.engine.submit(plan, wait_for=fences)
        except Exception as exc:  # the engine refused the plan: fail its swaps, roll back
            error = exc if isinstance(exc, TransferError) else TransferError(str(exc))
            for op in batch.ops:
                self._settle(op, error)
            self._wake_room_waiters()
            return
        self._queue.in_flight.append(batch)
        loop = self._loop
        assert loop is not None

        def on_done(_: object) -> None:  # runs on an engine thread (or here, if already done)
            with contextlib.suppress(RuntimeError):  # loop closed: close() settles the batch
                loop.call_soon_threadsafe(self._complete_batch, batch)

        batch.handle.future.add_done_callback(on_done)

    def _complete_batch(self, batch: _queue.Batch) -> None:
        if batch not in self._queue.in_flight:
            return  # already settled (close() and a late callback)
        self._queue.in_flight.remove(batch)
        assert batch.handle is not None
        future = batch.handle.future
        if not future.done():
            # closed while the copy may still run: fail the awaits but keep every block fenced
            # (no rollback: the DMA may still read or write them)
            for op in batch.ops:
                if not op.future.done():
                    op.future.set_exception(
                        ClosedError("manager closed while the copy was in flight")
                    )
                    op.future.exception()
            return
        error = future.exception()
        if error is None:
            result = future.result()
            self._completed.append(result)
            self._count_batch(result)
        elif not isinstance(error, (TransferError, ClosedError)):  # ClosedError: as is
            error = TransferError(f"transfer failed: {error!r}")
        for op in batch.ops:
            self._settle(op, error)
        self._wake_room_waiters()

    def _settle(self, op: _queue.Op, error: BaseException | None) -> None:
        """Apply an op's bookkeeping, then resolve its future (unless cancelled by its awaiter)."""
        if error is None:
            value = op.on_success()
            if not op.future.done():
                op.future.set_result(value)
        else:
            op.on_failure(error)
            if not op.future.done():
                op.future.set_exception(error)
                op.future.exception()  # mark retrieved: an unawaited failure is reported by stats

    # ------------------------------------------------------------------ waiting

    async def wait(self, future: asyncio.Future[Any], timeout_s: float | None = None) -> Any:
        """Await a swap's future with a deadline.

        On timeout the copy is NOT cancelled: its blocks stay fenced (PENDING keys, pinned
        readers, a moving block table) until the copy truly ends and its bookkeeping runs.
        Cancelling the awaiting task likewise leaves the copy and the bookkeeping intact.

        Raises:
            TransferTimeoutError: ``timeout_s`` seconds passed first.
            Whatever the swap raises (``TransferError``, ``ClosedError``, ...).
        """
        if timeout_s is not None and not (
            isinstance(timeout_s, (int, float)) and 0 <= timeout_s < float("inf")
        ):
            raise InvalidArgumentError(
                f"expected timeout_s >= 0 seconds or None, got {timeout_s!r}"
            )
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            self._rejected["timeout_await"] += 1
            raise TransferTimeoutError(
                f"swap not complete after {timeout_s} s; its blocks stay fenced until it ends"
            ) from None

    # ------------------------------------------------------------------ observability

    def statistics(self) -> ManagerStatistics:
        """A snapshot of totals and occupancy (see ``ManagerStatistics``)."""
        return self._snapshot(
            batches_in_flight=len(self._queue.in_flight), queued_swaps=len(self._queue)
        )

    def stream_wait_loads(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait on the device for every load
        in flight, without blocking the host (docs/transfer.md, rule 4). No-op on the host
        engine."""
        for batch in self._queue.in_flight:
            if batch.direction is Direction.H2D and batch.handle is not None:
                self.engine.stream_wait(batch.handle, stream)
