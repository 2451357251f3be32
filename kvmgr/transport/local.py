"""The in-process transport: one scheduler, one ``TransferWorker``, plain calls.

No serialization and no thread of its own: ``submit`` calls the worker, and the engine's
completion (on the engine's thread) reaches the event loop with one ``call_soon_threadsafe``,
as it did before the split; the job's outcome is then delivered to the function given at
construction, on the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from kvmgr.scheduler.jobs import JobOutcome, TransferJob
from kvmgr.transfer.engine import BatchHandle
from kvmgr.worker.worker import Submitted, TransferWorker

__all__ = ["LocalTransport"]


class LocalTransport:
    """Scheduler <-> one local worker.

    Args:
        worker: the rank's worker (its engine is closed by ``close``).
        deliver: called on the loop thread with each job's ``JobOutcome`` (once per job).
    """

    num_ranks = 1

    def __init__(self, worker: TransferWorker, deliver: Callable[[JobOutcome], None]) -> None:
        self.worker = worker
        self._deliver = deliver

    def moved(self) -> str | None:
        """Why a KV tensor moved since the worker was built, or ``None`` (checked once per
        flush, before any job is handed out)."""
        return self.worker.moved()

    def submit(
        self, job: TransferJob, loop: asyncio.AbstractEventLoop, *, checked: bool = False
    ) -> Submitted:
        """Hand ``job`` to the worker; its outcome is delivered on ``loop`` when it ends.
        ``checked``: `moved` returned ``None`` earlier in this step (``TransferWorker.submit``).

        Raises:
            KVMgrError: the worker refused it (nothing runs then; roll it back).
        """
        worker = self.worker
        try:
            submitted = worker.submit(job, checked=checked)
        except BaseException:
            worker.forget(job.job_id)  # a plan kept by ``order``
            raise
        handle = submitted.handle
        land, job_id = self._land, job.job_id

        def on_done(_: object) -> None:  # an engine thread, or here (a synchronous engine)
            if asyncio._get_running_loop() is loop:  # this loop's thread: no self-pipe wakeup
                loop.call_soon(land, job_id, handle)
                return
            with contextlib.suppress(RuntimeError):  # loop closed: close() settles the job
                loop.call_soon_threadsafe(land, job_id, handle)

        handle.future.add_done_callback(on_done)  # called at once if the copy ended already
        return submitted

    def track(self, job_id: int, handle: BatchHandle, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the outcome of a job the caller submitted to the worker's engine itself (a
        layerwise operation: one handle over its groups) like that of any other job."""
        self.worker.adopt(job_id, handle)
        land = self._land

        def on_done(_: object) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(land, job_id, handle)

        handle.future.add_done_callback(on_done)

    def _land(self, job_id: int, handle: BatchHandle) -> None:
        self.worker.forget(job_id)
        self._deliver(_outcome(job_id, handle))

    def outcome_now(self, job_id: int) -> JobOutcome | None:
        """The job's outcome if its copy has ended, else ``None`` (it may still run)."""
        handle = self.worker.handle(job_id)
        if handle is None or not handle.future.done():
            return None
        self.worker.forget(job_id)
        return _outcome(job_id, handle)

    async def wait(self, job_ids: Iterable[int], timeout_s: float | None) -> None:
        """Wait (bounded) until the copies of ``job_ids`` ended; outcomes are not consumed."""
        handles = [h for j in job_ids if (h := self.worker.handle(j)) is not None]
        if not handles:
            return
        waits = [asyncio.wrap_future(h.future) for h in handles]
        for wait in waits:  # outcomes go to the swaps' futures: mark these retrieved
            wait.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.wait(waits, timeout=timeout_s)

    def engine_batches(self, job_id: int) -> tuple[int | None, tuple[int, ...]]:
        """A tracked job's engine batch id and every engine batch it joins (one, or a
        layerwise job's groups), for snapshots; ``(None, ())`` if not tracked."""
        handle = self.worker.handle(job_id)
        if handle is None:
            return None, ()
        return handle.batch_id, tuple(getattr(handle, "member_ids", None) or (handle.batch_id,))

    def order(self, d2h: TransferJob, h2d: TransferJob) -> tuple[TransferJob, TransferJob]:
        """The order to submit a generation's two jobs in (the worker's engine may prefer the
        load first: ``plan_duplex`` of the engine ``"auto"``)."""
        return self.worker.order(d2h, h2d)

    def stream_wait(self, job_id: int, stream: Any = None) -> None:
        """Make ``stream`` wait on the device for a job's copy (no-op on the host engine)."""
        self.worker.stream_wait(job_id, stream)

    def close(self, timeout_s: float | None) -> None:
        """Close the worker's engine (bounded).

        Raises:
            TransferTimeoutError: copies still running.
        """
        self.worker.close(timeout_s)


def _outcome(job_id: int, handle: BatchHandle) -> JobOutcome:
    """The outcome of an ended job: ONE read of its future (each read takes the future's lock).
    A cancelled future raises ``CancelledError`` as ``exception()`` would; any other error the
    copy ended with (``BaseException`` included) is the outcome's error."""
    try:
        result = handle.future.result()
    except concurrent.futures.CancelledError:
        raise
    except BaseException as error:  # what ``exception()`` returns: the very object
        return JobOutcome(job_id, error)
    return JobOutcome(job_id, None, result.num_bytes, result.device_s, (result,))
