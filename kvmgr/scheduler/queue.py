"""The swap queue: queued parts in ordered generations, lanes per direction, batches in flight.

Private to ``kvmgr.scheduler``. Every swap call becomes one ``Part`` (one future, whatever the
number of blocks). Parts queued since the last flush sit in *generations*: one lane, and so one
plan, per direction per generation. A part joins the newest generation unless it touches a GPU
block that the generation already touches in a conflicting way (a load into a block a store
still reads, a store of a block a load writes, or two loads into one block); then it opens a new
generation, submitted after the previous one (docs/transfer.md, rule 5). The conflict test and
the fences between batches in flight use per-GPU-block marks (the last generation that read or
wrote a block, the last batch in flight per direction), so they cost one array operation per
part, never a set of block ids.
"""

from __future__ import annotations

import array

import numpy as np

from kvmgr._ids_c import ids_c
from kvmgr.pool.block_ids import sorted_distinct
from kvmgr.scheduler.jobs import Direction, TransferJob
from kvmgr.scheduler.lanes import Kind, Lane, Part

__all__ = ["Batch", "Generation", "Kind", "Lane", "Part", "SwapQueue"]


class Generation:
    """Parts that can share one plan per direction (``lanes`` by direction; ``d2h``/``h2d``
    name the same lanes without hashing an enum on the per-call path)."""

    __slots__ = ("d2h", "h2d", "lanes", "number")

    def __init__(self, number: int) -> None:
        self.number = number
        self.d2h = Lane(Direction.D2H)
        self.h2d = Lane(Direction.H2D)
        self.lanes = {Direction.D2H: self.d2h, Direction.H2D: self.h2d}

    def __len__(self) -> int:
        return len(self.d2h.parts) + len(self.h2d.parts)


class Batch:
    """One submitted job and the lane it completes.

    Attributes:
        seq: the job's id (submission order).
        lane: the parts completed by this batch.
        job: what the workers were given (the lane's ids, the jobs it waits for).
        submitted_s: ``time.perf_counter()`` at submission.
    """

    __slots__ = ("job", "lane", "seq", "submitted_s")

    def __init__(self, lane: Lane, job: TransferJob, submitted_s: float) -> None:
        self.seq = job.job_id
        self.lane = lane
        self.job = job
        self.submitted_s = submitted_s

    @property
    def gpu_ids(self) -> np.ndarray:
        """int64 ``[n]``: every part's GPU ids, aligned with ``cpu_ids``."""
        return self.job.gpu_ids

    @property
    def cpu_ids(self) -> np.ndarray:
        """int64 ``[n]``: every part's CPU ids."""
        return self.job.cpu_ids

    @property
    def wait_for(self) -> tuple[int, ...]:
        """Ids of the batches it was fenced on."""
        return self.job.wait_for

    @property
    def direction(self) -> Direction:
        return self.lane.direction


def _marks(num_blocks: int) -> tuple[array.array[int], np.ndarray]:
    marks = array.array("q", [-1]) * num_blocks
    return marks, np.frombuffer(marks, dtype=np.int64)


class SwapQueue:
    """Generations of queued parts plus the batches in flight, for a pool of GPU blocks."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self._next_generation = 1
        self.generations: list[Generation] = [Generation(0)]
        self.num_queued = 0
        #: batches in flight, by sequence number, in submission order
        self.in_flight: dict[int, Batch] = {}
        self._next_seq = 0
        # last generation that read (store) / wrote (load) each GPU block
        self._read, self._read_np = _marks(num_gpu_blocks)
        self._written, self._written_np = _marks(num_gpu_blocks)
        # last batch in flight per direction that touched each GPU block
        self._batch_marks = {d: _marks(num_gpu_blocks) for d in Direction}

    def __len__(self) -> int:
        return self.num_queued

    def add(self, part: Part) -> None:
        """Queue a part in the newest generation, or in a new one if it conflicts."""
        newest = self.generations[-1]
        number = newest.number
        ids, kind = part.gpu_ids, part.kind
        is_store = kind is Kind.STORE or kind is Kind.PREEMPT
        small, conflict = type(ids) is list, False
        # marks of ``number``: only blocks its D2H (read) or H2D (written) parts touch
        touched = newest.h2d.parts or (not is_store and newest.d2h.parts)
        if touched and small:  # a few ids: plain loops, no numpy
            written = self._written
            if is_store:
                for b in ids:
                    if written[b] == number:
                        conflict = True
                        break
            else:
                read = self._read
                for b in ids:
                    if written[b] == number or read[b] == number:
                        conflict = True
                        break
        elif touched:
            conflict = bool((self._written_np[ids] == number).any()) or (
                not is_store and bool((self._read_np[ids] == number).any())
            )
        if conflict:
            newest = Generation(self._next_generation)
            self._next_generation += 1
            self.generations.append(newest)
            number = newest.number
        self._mark(ids, is_store, number)
        calls = getattr(part.future, "num_calls", 1)  # a StoreFanOut: many recorded calls
        (newest.d2h if is_store else newest.h2d).add(part, calls)
        self.num_queued += calls

    def _mark(self, ids: list[int] | np.ndarray, is_store: bool, number: int) -> None:
        """Mark ``ids`` read (a store) or written (a load) by generation ``number``."""
        marks = self._read if is_store else self._written
        if type(ids) is list:
            for b in ids:
                marks[b] = number
            return
        module = ids_c()
        if module is None or not module.set_at(marks, ids, number):
            (self._read_np if is_store else self._written_np)[ids] = number

    def take(self) -> list[Generation]:
        """Remove and return every queued generation, oldest first."""
        taken = self.generations
        self.generations = [Generation(self._next_generation)]
        self._next_generation += 1
        self.num_queued = 0
        return taken

    def queued_parts(self) -> list[Part]:
        """Every queued part, oldest generation first."""
        return [p for g in self.generations for lane in g.lanes.values() for p in lane.parts]

    def next_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def fences(self, direction: Direction, gpu_ids: np.ndarray) -> list[Batch]:
        """Batches in flight of the other direction that touch any of ``gpu_ids``."""
        other = Direction.H2D if direction is Direction.D2H else Direction.D2H
        if not self.in_flight or len(gpu_ids) == 0:
            return []
        seqs = sorted_distinct(self._batch_marks[other][1][gpu_ids])
        in_flight = self.in_flight
        return [in_flight[s] for s in seqs.tolist() if s in in_flight]

    def launch(self, lane: Lane, submitted_s: float, *, fenced: bool = True) -> Batch:
        """Make the lane's job (its ids, fenced on the in-flight batches of the other direction
        that share GPU blocks, unless not ``fenced``: a layerwise job fences each group itself)
        and record it in flight."""
        gpu_ids, cpu_ids = lane.arrays()
        fences = self.fences(lane.direction, gpu_ids) if fenced else []
        waits = tuple([b.seq for b in fences]) if fences else ()  # no generator: ~1 us a step
        job = TransferJob(self.next_seq(), lane.direction, gpu_ids, cpu_ids, waits)
        batch = Batch(lane, job, submitted_s)
        self.in_flight[batch.seq] = batch
        self._batch_marks[batch.direction][1][gpu_ids] = batch.seq
        return batch

    def pop(self, seq: int) -> Batch | None:
        """Take batch ``seq`` out of flight (settled, refused or closed); ``None`` if it is not
        in flight. A batch leaving before an earlier one of its direction (its submission was
        refused, it failed early on a rank) hands its GPU blocks' marks back to the latest
        earlier batch still in flight that touches them, so later batches of the other
        direction are still fenced on that one (the one in flight since: it still reads or
        writes those blocks)."""
        batch = self.in_flight.pop(seq, None)
        if batch is None:
            return None
        direction = batch.direction
        earlier = [b for b in self.in_flight.values() if b.seq < seq and b.direction is direction]
        if earlier:
            marks = self._batch_marks[direction][1]
            ids = batch.gpu_ids
            mine = ids[marks[ids] == seq]
            if len(mine):
                marks[mine] = -1
                for b in earlier:  # in submission order: the latest toucher wins
                    hit = mine[np.isin(mine, b.gpu_ids)]
                    marks[hit] = b.seq
        return batch
