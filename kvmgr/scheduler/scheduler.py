"""The scheduler side of kvmgr: bookkeeping and the swap queue, turned into transfer jobs.

``Scheduler`` holds no tensors and imports no torch: it is what ``OffloadManager`` runs in one
process and what a rank-0 (or separate) scheduler process runs under tensor parallelism. Its
loop, driven by the caller:

1. ``books.prepare_*`` / ``books.requests.prepare_*`` -> a ``Part`` -> ``enqueue(part)``;
2. at a step, ``take()`` -> the queued lanes (per generation, one per direction, oldest first);
   ``launch(lane)`` -> a ``TransferJob`` (block ids, and the in-flight jobs of the other
   direction it must wait for), recorded in flight; hand it to every rank's worker;
3. when the job ended on every rank, ``complete(outcome)`` applies it and returns a ``Settled``
   record (the lane, whose futures the caller resolves, the error, and the keyed stores that
   became READY); a job that could not be handed out is rolled back with ``abort``.

Nothing is reported by callback: evictions are taken as data (``books.take_evicted``), landed
stores come back in ``Settled.landed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from kvmgr.config import ManagerConfig
from kvmgr.scheduler.bookkeeping import Bookkeeper, Landed
from kvmgr.scheduler.jobs import Direction, JobOutcome, KVGeometry, TransferJob
from kvmgr.scheduler.queue import Batch, Lane, Part, SwapQueue

__all__ = ["Scheduler", "Settled"]


@attrs.define(eq=False)
class Settled:
    """A lane whose outcome was applied to the bookkeeping (not frozen: a frozen attrs
    ``__init__`` costs ~3x on the completion path; read-only by use).

    Attributes:
        lane: its parts (resolve each ``part.future``: ``part.result`` on success, else
            ``error``).
        error: ``None`` on success, else what the parts' futures get.
        landed: keyed stores that became READY (for write-through), or ``None``.
        batch: the in-flight record it came from (``None`` for a lane never launched).
    """

    lane: Lane
    error: BaseException | None
    landed: Landed | None = None
    batch: Batch | None = None


class Scheduler:
    """Block tables, prefix index, policy, CPU-tier metadata, the swap queue and its jobs.

    Args:
        config: the manager's settings (``num_cpu_blocks``, policy, admission, ...).
        geometry: blocks and page bytes of one rank's KV cache (``KVGeometry``).
        blocks_ready: how many leading CPU blocks the workers' CPU-tier memory lets the
            allocator hand out now (pinning in the background); ``None``: all.
        keep_evicted: record evictions as data for lower tiers (``books.take_evicted``).

    Attributes:
        books: the ``Bookkeeper`` (read it through ``snapshot``; drive it through its
            ``prepare_*`` calls and this class).
        queue: the ``SwapQueue`` (queued generations, batches in flight by job id).
    """

    def __init__(
        self,
        config: ManagerConfig,
        geometry: KVGeometry,
        blocks_ready: Callable[[], int] | None = None,
        *,
        keep_evicted: bool = False,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.books = Bookkeeper(config, geometry, blocks_ready, keep_evicted=keep_evicted)
        self.queue = SwapQueue(geometry.num_gpu_blocks)

    def enqueue(self, part: Part) -> bool:
        """Queue a prepared part; ``False`` when it copies nothing (resolve it now)."""
        if len(part.gpu_ids) == 0:
            return False
        self.queue.add(part)
        return True

    def take(self) -> list[tuple[Lane, ...]]:
        """Remove and return every queued generation's lanes with parts, oldest generation
        first (D2H before H2D within one: the two never share a GPU block, so they may be
        submitted in either order)."""
        taken: list[tuple[Lane, ...]] = []
        for generation in self.queue.take():  # plain branches: a generator costs a step ~2 us
            d2h, h2d = generation.d2h, generation.h2d
            if d2h.parts:
                taken.append((d2h, h2d) if h2d.parts else (d2h,))
            elif h2d.parts:
                taken.append((h2d,))
        return taken

    def launch(self, lane: Lane, *, fenced: bool = True) -> TransferJob:
        """The lane's job, recorded in flight (fenced on the in-flight jobs of the other
        direction that share a GPU block, unless not ``fenced``)."""
        return self.queue.launch(lane, time.perf_counter(), fenced=fenced).job

    def abort(self, job: TransferJob, error: BaseException) -> Settled:
        """A launched job that no worker runs (submission refused): forget it, roll back."""
        batch = self.queue.pop(job.job_id)
        assert batch is not None, f"job {job.job_id} was not in flight"
        self.books.complete(batch.lane, job.gpu_ids, job.cpu_ids, ok=False)
        return Settled(batch.lane, error, None, batch)

    def fail(self, lane: Lane, error: BaseException) -> Settled:
        """A lane never launched (closed, KV tensors moved): roll its bookkeeping back."""
        gpu_ids, cpu_ids = lane.arrays()
        self.books.complete(lane, gpu_ids, cpu_ids, ok=False)
        return Settled(lane, error)

    def complete(self, outcome: JobOutcome) -> Settled | None:
        """Apply a job's outcome (every rank's, folded); ``None`` if already settled."""
        batch = self.queue.pop(outcome.job_id)
        if batch is None:
            return None
        counters = self.books.counters
        counters.completion_s.observe(time.perf_counter() - batch.submitted_s)
        ok = outcome.error is None
        if ok:
            if batch.job.direction is Direction.D2H:
                counters.bytes_d2h += outcome.num_bytes
                counters.device_s_d2h += outcome.device_s or 0.0
            else:
                counters.bytes_h2d += outcome.num_bytes
                counters.device_s_h2d += outcome.device_s or 0.0
        landed = self.books.complete(batch.lane, batch.gpu_ids, batch.cpu_ids, ok=ok)
        return Settled(batch.lane, outcome.error, landed, batch)
