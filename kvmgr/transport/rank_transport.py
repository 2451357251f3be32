"""``RankTransport``: the scheduler's side of a ``RankGroup``, each job sent to every rank.

Choice of transport, and its cost: one pair of Unix pipes per rank (``multiprocessing.Pipe``),
msgspec msgpack frames (``frames.py``). Per job the scheduler encodes one ``JobFrame`` (the two
id arrays as raw int64 bytes) and writes the same bytes to every rank; each rank answers one
``DoneFrame`` when its copy ended. The rank pipes are read on the scheduler's event loop
(``loop.add_reader``), so no thread of ours sits between a rank's answer and the bookkeeping.
There is no collective at all, so none can be conditional on local state (the SGLang #30760
deadlock): every rank receives every job, in one order, and answers each one. torch.distributed
(gloo) was the other candidate; it needs every rank in every collective and a blocking
``recv`` per answer, which this design avoids. ``kvmgr bench ranks`` measures the cost.

A job completes when every rank reported success. If a rank reports failure the job fails on
every rank with ``RankError(rank=...)`` once all ranks have answered (until then the others may
still copy). If a rank's pipe closes (it died) or a job misses ``deadline_s``, the group is
*down*: every job in flight fails with ``RankError`` / ``RankTimeoutError`` naming the rank (a
job the other ranks still hold once they answered it, so its blocks are rolled back only when
no rank copies any more), and every later job is refused (the manager stops offloading: new
swaps fail fast instead of hanging). No job is sent after that, so the blocks rolled back are
never copied again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvmgr.errors import RankError, RankTimeoutError
from kvmgr.scheduler.jobs import Direction, JobOutcome, KVGeometry, TransferJob
from kvmgr.transport._outbox import Outbox
from kvmgr.transport.frames import DoneFrame, decode, encode, job_frame


class Ranks(Protocol):
    """What the transport uses of a started ``RankGroup`` (``group.py``, which imports this
    module: the protocol keeps the import one-way)."""

    num_ranks: int
    deadline_s: float
    geometry: KVGeometry
    jobs: list[Any]  #: per rank, the scheduler's end of its job pipe
    processes: list[Any]  #: per rank, its process (``exitcode`` once it died)


__all__ = ["RankTransport", "Ranks"]


class _Pending:
    __slots__ = ("done", "error", "job", "left", "max_device_s", "num_bytes", "timer", "waiter")

    def __init__(self, job: TransferJob, num_ranks: int) -> None:
        self.job = job
        self.left = set(range(num_ranks))
        self.num_bytes = 0
        self.max_device_s: float | None = None
        self.error: RankError | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.done = False


class RankTransport:
    """Scheduler <-> the ranks of a ``RankGroup`` (see the module docstring).

    Args:
        group: the started ranks.
        deliver: called on the loop thread with each job's folded ``JobOutcome``.

    Attributes:
        down: ``None`` while every rank answers; else the ``RankError`` that took the group
            down (every later job is refused with it).
    """

    def __init__(self, group: Ranks, deliver: Callable[[JobOutcome], None]) -> None:
        self.group = group
        self.num_ranks = group.num_ranks
        self._deliver = deliver
        self._pending: dict[int, _Pending] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.down: RankError | None = None
        geometry = group.geometry
        self._num_tensors = len(geometry.page_bytes)
        self._block_bytes = geometry.block_bytes
        self._replicated = geometry.layout == "replicated"
        self._boxes = [Outbox(conn) for conn in group.jobs]  # never a blocking write

    def moved(self) -> str | None:
        """Always ``None``: each rank checks its own tensors when it submits."""
        return None

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is self._loop:
            return
        self._unbind()
        for rank, conn in enumerate(self.group.jobs):
            loop.add_reader(conn.fileno(), self._readable, rank)
        self._loop = loop
        for rank, box in enumerate(self._boxes):
            if box.frames:
                loop.add_writer(box.fd, self._drain, rank)

    def _unbind(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        for conn in self.group.jobs:
            with contextlib.suppress(OSError, ValueError):  # closed already
                loop.remove_reader(conn.fileno())
                loop.remove_writer(conn.fileno())

    def submit(
        self, job: TransferJob, loop: asyncio.AbstractEventLoop, *, checked: bool = False
    ) -> Any:
        """Send ``job`` to every rank (the same frame bytes, one write per rank). ``checked``
        is ignored: each rank checks its own KV tensors.

        Raises:
            RankError: the group is down, or a rank's pipe is closed (the group goes down).
        """
        if self.down is not None:
            raise RankError(f"offload is off: {self.down}", rank=self.down.rank)
        self._bind(loop)
        data = encode(job_frame(job))
        pending = _Pending(job, self.num_ranks)
        self._pending[job.job_id] = pending
        for rank, box in enumerate(self._boxes):
            try:
                if not box.put(job.job_id, data):  # the pipe is full: the loop sends the rest
                    loop.add_writer(box.fd, self._drain, rank)
            except OSError:
                error = RankError(f"rank {rank} is gone (its pipe is closed)", rank=rank)
                loop.call_soon(self._go_down, error)
                if rank == 0:  # no rank has the job: the caller rolls it back
                    del self._pending[job.job_id]
                    raise error from None
                pending.left, pending.error = set(range(rank)), error  # those ranks may copy:
                # it fails once they answered
                break
        pending.timer = loop.call_later(self.group.deadline_s, self._expire, job.job_id)
        return _submitted(
            job, self.num_ranks, self._num_tensors, self._block_bytes, self._replicated
        )

    def _drain(self, rank: int) -> None:
        box = self._boxes[rank]
        try:
            done = box.drain()
        except OSError:
            done = True
            self._go_down(RankError(f"rank {rank} is gone (its pipe is closed)", rank=rank))
        if done and self._loop is not None:
            with contextlib.suppress(OSError, ValueError):
                self._loop.remove_writer(box.fd)

    # ------------------------------------------------------------------ answers

    def _readable(self, rank: int) -> None:
        conn = self.group.jobs[rank]
        try:
            while conn.poll():
                frame = decode(conn.recv_bytes())
                if isinstance(frame, DoneFrame):
                    self._answer(frame)
        except (EOFError, OSError):  # a closed pipe stays readable: stop watching it
            if self._loop is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._loop.remove_reader(conn.fileno())
            code = self.group.processes[rank].exitcode
            self._go_down(RankError(f"rank {rank} died (pipe closed, exit code {code})", rank=rank))

    def _answer(self, frame: DoneFrame) -> None:
        pending = self._pending.get(frame.job_id)
        if pending is None or frame.rank not in pending.left:
            return
        pending.left.discard(frame.rank)
        if frame.error is not None and pending.error is None:
            pending.error = RankError(
                f"rank {frame.rank} failed job {frame.job_id}: {frame.error}", rank=frame.rank
            )
        pending.num_bytes += frame.num_bytes
        if frame.device_s is not None:
            pending.max_device_s = max(pending.max_device_s or 0.0, frame.device_s)
        if not pending.left:
            self._finish(pending)

    def _finish(self, pending: _Pending) -> None:
        del self._pending[pending.job.job_id]
        pending.done = True
        if pending.timer is not None:
            pending.timer.cancel()
        if pending.waiter is not None and not pending.waiter.done():
            pending.waiter.set_result(None)
        error = pending.error
        self._deliver(
            JobOutcome(pending.job.job_id, error, pending.num_bytes, pending.max_device_s)
        )

    def _expire(self, job_id: int) -> None:
        pending = self._pending.get(job_id)
        if pending is None:
            return
        rank = min(pending.left)
        self._go_down(
            RankTimeoutError(
                f"rank {rank} did not finish job {job_id} within {self.group.deadline_s} s",
                rank=rank,
            )
        )

    def _go_down(self, error: RankError) -> None:
        """A rank is lost: fail every job in flight with ``error``; refuse new ones. A rank
        that died copies nothing more, but the others may still be inside a job: it fails once
        they answered (or missed the deadline: fenced for good), never while they may touch
        its blocks (rolled back, a load's GPU blocks go to other requests)."""
        if self.down is None:
            self.down = error
        timeout = isinstance(error, RankTimeoutError)
        for rank, box in enumerate(self._boxes):  # jobs not sent yet are never sent
            for job_id in box.drop_unstarted():
                pending = self._pending.get(job_id)
                if pending is not None:
                    pending.left.discard(rank)  # that rank never saw the job
        for pending in list(self._pending.values()):
            if timeout or pending.error is None:
                pending.error = error
            if timeout:
                pending.left.clear()
            else:
                pending.left.discard(error.rank)
            if not pending.left:
                self._finish(pending)

    # ------------------------------------------------------------------ the rest

    def outcome_now(self, job_id: int) -> JobOutcome | None:
        """``None``: outcomes are delivered as soon as every rank answered."""
        return None

    async def wait(self, job_ids: Iterable[int], timeout_s: float | None) -> None:
        """Wait (bounded) until the jobs are answered by every rank (or failed)."""
        loop = asyncio.get_running_loop()
        waits = []
        for job_id in job_ids:
            pending = self._pending.get(job_id)
            if pending is not None:
                if pending.waiter is None:
                    pending.waiter = loop.create_future()
                waits.append(pending.waiter)
        if waits:
            await asyncio.wait(waits, timeout=timeout_s)

    def engine_batches(self, job_id: int) -> tuple[int | None, tuple[int, ...]]:
        """``(None, ())``: the batches live in the rank processes."""
        return None, ()

    def order(self, d2h: TransferJob, h2d: TransferJob) -> tuple[TransferJob, TransferJob]:
        """Stores first (each rank's engine orders its own copies)."""
        return d2h, h2d

    def stream_wait(self, job_id: int, stream: Any = None) -> None:
        """No-op: each rank fences its own compute stream."""

    def close(self, timeout_s: float | None) -> None:
        """Stop reading the ranks; the group itself is closed by its owner."""
        self._unbind()
        for box in self._boxes:
            box.close()


class _Counts:
    """The step report's counts for a job sent to every rank (the plans live in the ranks:
    pages and descriptors are the unmerged upper bound, bytes the sum over ranks)."""

    __slots__ = ("num_blocks", "num_bytes", "num_descriptors", "num_pages")

    def __init__(self, num_blocks: int, num_pages: int, num_bytes: int) -> None:
        self.num_blocks = num_blocks
        self.num_pages = num_pages
        self.num_descriptors = num_pages
        self.num_bytes = num_bytes


def _submitted(
    job: TransferJob, num_ranks: int, num_tensors: int, block_bytes: int, replicated: bool
) -> _Counts:
    n = job.num_blocks
    copies = n if replicated and job.direction is Direction.D2H else n * num_ranks
    return _Counts(n, copies * num_tensors, copies * block_bytes)
