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
import asyncio
import enum
from collections.abc import Hashable
from typing import Any

import numpy as np

from kvmgr.scheduler.jobs import Direction, TransferJob

__all__ = ["Batch", "Generation", "Kind", "Lane", "Part", "SwapQueue"]


class Kind(enum.IntEnum):
    """What a part does; the direction follows from it."""

    STORE = 0  #: keyed GPU -> CPU
    LOAD = 1  #: keyed CPU -> GPU
    PREEMPT = 2  #: a request's blocks GPU -> CPU
    RESUME = 3  #: a request's blocks CPU -> GPU


class Part:
    """One swap call's share of a lane.

    Attributes:
        kind: what it does.
        future: resolved with ``result`` once the copy and its bookkeeping completed.
        result: the value the future gets on success (built when the part was prepared).
        gpu_ids / cpu_ids: its block ids (list or int64 array), GPU read/written and CPU
            written/read, aligned.
        keys: keyed parts: the keys copied, aligned with the ids; else ``None``.
        req_id: request-level parts: the request; else ``None``.
        parents: keyed stores: ``parents[i]`` is the key ``keys[i]`` extends (``None``: a root),
            for the ``stored`` event; ``None`` for the default chain (``keys[i]`` extends
            ``keys[i - 1]``, ``keys[0]`` a root: no list kept per queued call) and for others.
        token_ids: keyed stores given token ids: int32 ``[len(keys), block_size]`` (the
            caller's copy, rows of the keys stored); else ``None``.
    """

    __slots__ = (
        "cpu_ids", "future", "gpu_ids", "keys", "kind", "parents", "req_id", "result", "token_ids"
    )  # fmt: skip

    def __init__(
        self,
        kind: Kind,
        future: asyncio.Future[Any],
        result: object,
        gpu_ids: Any,
        cpu_ids: Any,
        keys: list[bytes] | None = None,
        req_id: Hashable | None = None,
        *,
        parents: list[bytes | None] | None = None,
        token_ids: np.ndarray | None = None,
    ) -> None:
        self.kind = kind
        self.future = future
        self.result = result
        self.gpu_ids = gpu_ids
        self.cpu_ids = cpu_ids
        self.keys = keys
        self.req_id = req_id
        self.parents = parents
        self.token_ids = token_ids

    @property
    def direction(self) -> Direction:
        """D2H for stores and preempts, H2D for loads and resumes."""
        return Direction.D2H if self.kind in (Kind.STORE, Kind.PREEMPT) else Direction.H2D


class Lane:
    """One direction of a generation: its parts and their block ids, accumulated cheaply.

    Ids accumulate in part order in int64 ``array.array`` buffers (a small part's list is
    appended in C, a large part's array copied in), so ``arrays()`` is two zero-copy views. A
    D2H lane also accumulates its keyed stores' keys, and request-level parts (preempts,
    resumes) are listed apart, so completion never walks every part.

    Attributes:
        parts: every part, in the order added.
        num_calls: the swap calls its parts stand for (a part of recorded per-call stores
            stands for many).
        keys: D2H lanes: the keys of the keyed stores, in part order (aligned with the ids when
            ``requests`` is empty); H2D lanes: empty.
        parents: D2H lanes: one parent per entry of ``keys`` (``None``: a root).
        num_token_parts: keyed stores of the lane that carry token ids.
        requests: the request-level parts (preempts, resumes), in part order.
    """

    __slots__ = (
        "_cpu", "_gpu", "direction", "keys", "num_calls", "num_token_parts", "parents", "parts",
        "requests",
    )  # fmt: skip

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.parts: list[Part] = []
        self.keys: list[bytes] = []
        self.parents: list[bytes | None] = []
        self.num_token_parts = 0
        self.num_calls = 0
        self.requests: list[Part] = []
        self._gpu = array.array("q")
        self._cpu = array.array("q")

    def add(self, part: Part, num_calls: int = 1) -> None:
        """Append a part standing for ``num_calls`` swap calls (not after ``arrays()``: its
        views pin the buffers' size)."""
        self.parts.append(part)
        self.num_calls += num_calls
        gpu, cpu = part.gpu_ids, part.cpu_ids
        if type(gpu) is list:
            self._gpu.fromlist(gpu)
        else:
            self._gpu.frombytes(_raw(gpu))
        if type(cpu) is list:
            self._cpu.fromlist(cpu)
        else:
            self._cpu.frombytes(_raw(cpu))
        keys = part.keys
        if keys is None:
            self.requests.append(part)
        elif self.direction is Direction.D2H:
            self.keys += keys
            if part.parents is not None:
                self.parents += part.parents
            elif keys:  # the default chain
                self.parents.append(None)
                self.parents += keys[:-1]
            if part.token_ids is not None:
                self.num_token_parts += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(GPU ids, CPU ids) of every part, int64, aligned, in part order (views of the
        lane's buffers: read them, do not write)."""
        return np.frombuffer(self._gpu, dtype=np.int64), np.frombuffer(self._cpu, dtype=np.int64)


def _raw(ids: Any) -> np.ndarray:
    """The bytes of an int64 id array, for ``array.frombytes`` (no copy when already int64)."""
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint8)


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
        ids = part.gpu_ids
        kind = part.kind
        is_store = kind is Kind.STORE or kind is Kind.PREEMPT
        small = type(ids) is list
        conflict = False
        if small:  # a few ids: plain loops, no numpy
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
        else:
            conflict = bool((self._written_np[ids] == number).any()) or (
                not is_store and bool((self._read_np[ids] == number).any())
            )
        if conflict:
            newest = Generation(self._next_generation)
            self._next_generation += 1
            self.generations.append(newest)
            number = newest.number
        if small:
            marks = self._read if is_store else self._written
            for b in ids:
                marks[b] = number
        else:
            (self._read_np if is_store else self._written_np)[ids] = number
        calls = getattr(part.future, "num_calls", 1)  # a StoreFanOut: many recorded calls
        (newest.d2h if is_store else newest.h2d).add(part, calls)
        self.num_queued += calls

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
        seqs = np.unique(self._batch_marks[other][1][gpu_ids])
        in_flight = self.in_flight
        return [in_flight[s] for s in seqs.tolist() if s in in_flight]

    def launch(self, lane: Lane, submitted_s: float, *, fenced: bool = True) -> Batch:
        """Make the lane's job (its ids, fenced on the in-flight batches of the other direction
        that share GPU blocks, unless not ``fenced``: a layerwise job fences each group itself)
        and record it in flight."""
        gpu_ids, cpu_ids = lane.arrays()
        fences = self.fences(lane.direction, gpu_ids) if fenced else []
        job = TransferJob(
            self.next_seq(), lane.direction, gpu_ids, cpu_ids, tuple(b.seq for b in fences)
        )
        batch = Batch(lane, job, submitted_s)
        self.in_flight[batch.seq] = batch
        self._batch_marks[batch.direction][1][gpu_ids] = batch.seq
        return batch
