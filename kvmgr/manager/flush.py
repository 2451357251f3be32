"""Flush and completion: the scheduler's lanes -> jobs -> the transport -> outcomes -> futures.

Private to ``kvmgr.manager``. ``Flusher.flush`` takes every queued lane from the scheduler,
launches each as a ``TransferJob`` and hands it to the transport (the in-process worker, or
every rank's). ``complete`` is the one function that reacts to a job's end, on the loop thread:
the scheduler applies the bookkeeping of the whole lane with array operations, stores that
landed are written through to lower tiers, the lane's futures are resolved, waiting stores
retry.

Errors: a job that cannot be submitted (a typed kvmgr error) fails that lane's swaps with
``TransferError`` and rolls their bookkeeping back; any other exception (a bug) fails them with
that very exception and is re-raised after the other lanes were submitted, so nothing is
orphaned and nothing is relabelled.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from kvmgr.errors import (
    ClosedError,
    InvalidArgumentError,
    KVMgrError,
    RankTimeoutError,
    StaleKVTensorError,
    TransferError,
)
from kvmgr.hooks import HookReport, StepHook
from kvmgr.manager.backpressure import RoomWaiters
from kvmgr.reports import DirectionReport
from kvmgr.scheduler import Direction, JobOutcome, Scheduler, Settled, TransferJob
from kvmgr.scheduler.queue import Lane

__all__ = ["Flusher"]

#: Completed-batch results kept for the next ``StepReport`` (older ones are dropped, so a
#: caller that never calls ``step()``, e.g. with ``flush="tick"``, does not grow memory).
MAX_COMPLETED = 4096

_NOTHING = DirectionReport()  # frozen: shared by every flush that submits nothing
_D2H = Direction.D2H


class Flusher:
    """Submits the scheduler's jobs through a transport and settles their outcomes.

    Args:
        scheduler: the scheduler side.
        room: stores waiting for room (woken whenever a lane settles).
        tiers: the lower tiers (``LowerTiers``) or ``None``.
        connect: builds the transport given the function it delivers outcomes to
            (``complete``), e.g. ``lambda deliver: LocalTransport(worker, deliver)``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        room: RoomWaiters,
        tiers: Any,
        connect: Callable[[Callable[[JobOutcome], None]], Any],
    ) -> None:
        self.scheduler = scheduler
        self.room = room
        self.tiers = tiers
        self.transport = connect(self.complete)
        self._moved = self.transport.moved  # bound once: called once per flush
        self._completed: collections.deque[object] = collections.deque(maxlen=MAX_COMPLETED)

    @staticmethod
    def check_hook_reports(hooks: Sequence[StepHook], reports: Sequence[object]) -> None:
        """Raises InvalidArgumentError: a hook returned something else than a HookReport."""
        for hook, report in zip(hooks, reports):
            if not isinstance(report, HookReport):
                if inspect.iscoroutine(report):  # an async hook: never awaited, say so once
                    report.close()
                raise InvalidArgumentError(
                    f"hook {getattr(hook, 'name', hook)!r} returned "
                    f"{type(report).__name__}, expected a HookReport (is it async?)"
                )

    def take_completed(self) -> tuple[Any, ...]:
        """Results of the batches completed since the last call."""
        completed = tuple(self._completed)
        self._completed.clear()
        return completed

    # ------------------------------------------------------------------ flush

    def flush(self, loop: asyncio.AbstractEventLoop) -> tuple[DirectionReport, DirectionReport]:
        """Submit every queued lane; returns the (D2H, H2D) reports of this flush."""
        scheduler = self.scheduler
        generations = scheduler.take()
        d2h = h2d = _NOTHING
        if not generations:
            return d2h, h2d
        moved = self._moved()
        if self.tiers is not None:  # evicted blocks' pages, before a store may overwrite them
            self.tiers.write_evicted(scheduler.books.take_evicted(), loop)
        bug: BaseException | None = None
        for lanes in generations:
            if moved is not None:
                for lane in lanes:
                    self._settle(scheduler.fail(lane, StaleKVTensorError(moved)))
                continue
            if len(lanes) == 1:  # one direction: no order to choose (the usual generation)
                jobs: Sequence[tuple[TransferJob, Lane]] = ((scheduler.launch(lanes[0]), lanes[0]),)  # fmt: skip
            else:
                jobs = [(scheduler.launch(lane), lane) for lane in lanes]
                first, _ = self.transport.order(jobs[0][0], jobs[1][0])  # the load first?
                if first is not jobs[0][0]:
                    jobs.reverse()
            for job, lane in jobs:
                try:
                    report = self._submit(job, lane, loop)  # moved() was None just above
                except Exception as exc:  # a bug: fail the swaps with it, raise after the rest
                    bug = bug or exc
                    continue
                if report is None:
                    continue
                if job.direction is _D2H:
                    d2h = report if d2h is _NOTHING else d2h + report
                else:
                    h2d = report if h2d is _NOTHING else h2d + report
        if bug is not None:
            raise bug
        return d2h, h2d

    def _submit(
        self, job: TransferJob, lane: Lane, loop: asyncio.AbstractEventLoop
    ) -> DirectionReport | None:
        """Hand a launched job to the transport; ``None`` if refused (rolled back, failed).

        Raises:
            Exception: a bug (not a kvmgr error); the job was rolled back and failed with it.
        """
        scheduler = self.scheduler
        try:
            sub = self.transport.submit(job, loop, checked=True)
        except KVMgrError as exc:
            error = (
                exc
                if isinstance(exc, TransferError)
                else TransferError(f"could not submit the {job.direction.value} batch: {exc}")
            )
            self._settle(scheduler.abort(job, error))
            return None
        except Exception as exc:
            self._settle(scheduler.abort(job, exc))
            raise
        scheduler.books.counters.batch_blocks.observe(job.num_blocks)
        return DirectionReport(
            swaps=lane.num_calls,
            blocks=sub.num_blocks,
            pages=sub.num_pages,
            descriptors=sub.num_descriptors,
            bytes=sub.num_bytes,
            batches=1,
        )

    # ------------------------------------------------------------------ completion

    def complete(self, outcome: JobOutcome) -> None:
        """A job ended on every rank (on the loop thread): bookkeeping, write-through,
        futures, waiting stores. A no-op if the job was already settled. A job a rank did not
        finish by the deadline stays in flight, its awaits failed: that rank is alive and may
        still copy, so its GPU and CPU blocks stay fenced for good (the offload is off)."""
        error = outcome.error
        if error is not None and isinstance(error, RankTimeoutError):
            if (batch := self.scheduler.queue.in_flight.get(outcome.job_id)) is not None:
                _resolve(batch.lane, error)
            return
        settled = self.scheduler.complete(outcome)
        if settled is None:
            return
        self._completed.extend(outcome.results)
        self._settle(settled)

    def _settle(self, settled: Settled) -> None:
        if settled.landed is not None and self.tiers is not None:
            self.tiers.write_landed(settled.landed)
        _resolve(settled.lane, settled.error)
        self.room.wake()

    def fail_queued(self, error: BaseException) -> None:
        """Fail every queued (not submitted) swap with ``error``; roll their bookkeeping back."""
        for lanes in self.scheduler.take():
            for lane in lanes:
                self._settle(self.scheduler.fail(lane, error))

    def settle_at_close(self) -> None:
        """Closing: settle every job in flight whose copy ended; fail the awaits of the others
        but keep their blocks fenced (no rollback: a DMA may still read or write them)."""
        queue = self.scheduler.queue
        for seq in list(queue.in_flight):
            outcome = self.transport.outcome_now(seq)
            if outcome is not None:
                self.complete(outcome)
            else:
                self._abandon(seq, ClosedError("manager closed while the copy was in flight"))

    def _abandon(self, seq: int, error: BaseException) -> None:
        """Fail the awaits of in-flight batch ``seq`` with ``error``, without rollback: its
        blocks stay fenced (a DMA or a late rank may still read or write them)."""
        if (batch := self.scheduler.queue.pop(seq)) is not None:
            _resolve(batch.lane, error)


def _resolve(lane: Lane, error: BaseException | None) -> None:
    """Resolve the lane's futures (those not cancelled by their awaiters)."""
    if error is None:
        for part in lane.parts:
            try:
                part.future.set_result(part.result)
            except asyncio.InvalidStateError:  # cancelled: its awaiter gave up
                continue
        return
    for part in lane.parts:
        future = part.future
        if not future.done():
            future.set_exception(error)
            future.exception()  # mark retrieved: an unawaited failure is reported by stats
