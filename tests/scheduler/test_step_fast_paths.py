"""The step path's shortcuts (issue 27, helper stepfast) give what the long way gives.

1. ``landing._emit_stored`` on default chains (``Lane.parents``' one-store shortcut among
   them) records the same ``stored`` event as the events' own call builds, for
   random lanes of one or more stores, with and without explicit parents and token rows.
2. ``LocalTransport.submit`` delivers each job's outcome once, on the loop thread, after the
   submit returned: for a copy that ended inside ``submit`` (no self-pipe write: the loop's
   ``call_soon``), for one that ends on another thread, and for a failed one.
3. A manager's program through one-lane generations (stores only) and the same stores with a
   load in most steps (two-lane generations, the engine's order asked): every store's result,
   the stored events and the blocks stored agree.
4. ``local._outcome`` (helper stepfast2) reads an ended job's future once: the outcome the two
   reads gave, for a result, an error, a ``BaseException`` and a cancelled future.
5. ``Flusher._submit``'s ``DirectionReport`` is the one built from its job's counts, ints only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import TransferError
from kvmgr.manager.flush import Flusher
from kvmgr.reports import DirectionReport
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.events import EventStream
from kvmgr.scheduler.jobs import JobOutcome
from kvmgr.scheduler.landing import _emit_stored
from kvmgr.scheduler.queue import Kind, Lane, Part
from kvmgr.testing import NullEngine
from kvmgr.transfer.engine import BatchHandle, BatchResult
from kvmgr.transfer.plan import Direction
from kvmgr.transport.local import LocalTransport, _outcome
from kvmgr.worker.worker import Submitted


class _Books:
    def __init__(self) -> None:
        self.events = EventStream(100)


def _store(loop: asyncio.AbstractEventLoop, keys: list[bytes], **kw: Any) -> Part:
    ids = np.arange(len(keys), dtype=np.int64)
    return Part(Kind.STORE, loop.create_future(), None, ids, ids, keys, **kw)


def _general(lane: Lane) -> Any:
    """The event the general path records (``Lane.parents``) for a lane without token rows."""
    events = EventStream(100)
    events.stored(lane.keys, lane.parents)
    return events.take()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(12))
async def test_the_stored_event_of_a_default_chain_is_the_general_one(seed: int) -> None:
    rng, loop = random.Random(seed), asyncio.get_running_loop()
    n = 0
    for _ in range(20):
        lane = Lane(Direction.D2H)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            keys = [b"k%d" % (n + i) for i in range(rng.randint(1, 6))]
            n += len(keys)
            explicit = rng.random() < 0.3
            parents = [rng.choice([None, *keys]) for _ in keys] if explicit else None
            lane.add(_store(loop, keys, parents=parents), 1)
        books = _Books()
        _emit_stored(books, lane)  # type: ignore[arg-type]
        (got,) = books.events.take()
        (want,) = _general(lane)
        assert got == want and got.parents == want.parents and got.keys == tuple(lane.keys)
        assert type(got.parents) is tuple and got.token_ids is None


@pytest.mark.asyncio
async def test_the_stored_event_keeps_the_store_keys_as_they_were_when_it_landed() -> None:
    loop = asyncio.get_running_loop()
    keys = [b"a", b"b", b"c"]
    lane = Lane(Direction.D2H)
    lane.add(_store(loop, keys), 1)
    books = _Books()
    _emit_stored(books, lane)  # type: ignore[arg-type]
    keys[0] = b"changed"  # the caller's list: the event holds its own tuple
    (event,) = books.events.take()
    assert event.keys == (b"a", b"b", b"c") and event.parents == (None, b"a", b"b")


class _Worker:
    """The worker side ``LocalTransport`` calls: ``submit`` returns a prepared handle."""

    def __init__(self, handle: BatchHandle) -> None:
        self.handle_ = handle
        self.forgotten: list[int] = []

    def moved(self) -> None:
        return None

    def submit(self, job: Any, *, checked: bool = False) -> Any:
        class _Sub:
            handle = self.handle_

        return _Sub()

    def forget(self, job_id: int) -> None:
        self.forgotten.append(job_id)


class _Job:
    job_id = 7


def _result() -> BatchResult:
    return BatchResult(batch_id=0, direction=Direction.D2H, num_bytes=64, num_descriptors=1,
                       device_s=None, path="test")  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["ended", "thread", "failed"])
async def test_local_transport_delivers_once_on_the_loop_after_submit(when: str) -> None:
    loop = asyncio.get_running_loop()
    future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
    if when == "ended":
        future.set_result(_result())
    handle = BatchHandle(0, Direction.D2H, future)
    worker, got, threads = _Worker(handle), [], []
    transport = LocalTransport(worker, lambda o: (got.append(o), threads.append(threading.get_ident())))  # type: ignore[arg-type]  # fmt: skip
    assert transport.moved() is None
    transport.submit(_Job(), loop)  # type: ignore[arg-type]
    assert got == []  # never inside submit, even for a copy that ended already
    if when == "thread":
        threading.Thread(target=future.set_result, args=(_result(),)).start()
    elif when == "failed":
        threading.Thread(target=future.set_exception, args=(TransferError("x"),)).start()
    for _ in range(200):
        if got:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.01)
    assert len(got) == 1 and got[0].job_id == 7 and threads == [threading.get_ident()]
    assert worker.forgotten == [7]
    if when == "failed":
        assert isinstance(got[0].error, TransferError) and got[0].results == ()
    else:
        assert got[0].error is None and got[0].num_bytes == 64 and len(got[0].results) == 1


async def _program(mixed: bool, seed: int) -> tuple[list[Any], int, list[Any]]:
    """Random rounds of stores (and, when ``mixed``, a load of a stored key in the same step:
    two-lane generations); returns the stores' results, the blocks stored and the stored
    events (keys, parents)."""
    rng, loads = random.Random(seed), random.Random(seed + 1000)  # the stores' draws alike
    kv = [torch.zeros(64, 256, dtype=torch.uint8) for _ in range(3)]
    config = ManagerConfig(num_cpu_blocks=48)
    stored: list[list[bytes]] = []
    results: list[Any] = []
    events: list[Any] = []
    async with OffloadManager(kv, config, engine=NullEngine()) as mgr:
        ids = mgr.allocate("r", 64)
        for r in range(12):
            n = rng.randint(1, 6)
            keys = [b"%d:%d" % (r, i) for i in range(n)]
            store = mgr.store_many(np.array(ids[:n], dtype=np.int64), keys)
            load = None
            if mixed and stored:
                old = stored[loads.randrange(len(stored))]
                present = [k for k in old if mgr.peek([k])]
                if present:
                    load = mgr.load_many(present[:1], np.array(ids[32:33], dtype=np.int64))
            report = await mgr.step()
            got = await store
            results.append((got.stored.tolist(), got.present.tolist(), got.cpu_block_ids.tolist(), got.num_bytes))  # fmt: skip
            if load is not None:
                await load
            assert report.d2h.batches == 1 and report.h2d.batches == (load is not None)
            stored.append(keys)
            events += [(e.keys, e.parents) for e in mgr.take_events() if e.kind == "stored"]
        stores = mgr.statistics().stores_completed
    return results, stores, events


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(4))
async def test_one_and_two_lane_generations_store_the_same(seed: int) -> None:
    alone = await _program(False, seed)
    mixed = await _program(True, seed)
    assert alone[0] == mixed[0]  # every store's result
    assert alone[2] == mixed[2] and alone[2]  # the stored events, parents included
    assert alone[1] == mixed[1] > 0


class _Stop(BaseException):
    """Not an ``Exception``: ``exception()`` returns it like any other error."""


def _two_reads(job_id: int, handle: BatchHandle) -> Any:
    """The outcome as read before (``exception()``, then ``result()``): the reference."""
    error = handle.future.exception()
    if error is not None:
        return JobOutcome(job_id, error)
    result = handle.future.result()
    return JobOutcome(job_id, None, result.num_bytes, result.device_s, (result,))


@pytest.mark.parametrize("end", ["result", "error", "base", "cancelled"])
def test_the_one_read_outcome_is_the_two_read_one(end: str) -> None:
    """4. ``local._outcome`` reads the ended future once (its result, or the error it raises):
    the same outcome as ``exception()`` then ``result()``, the very error object, and a
    cancelled future raises ``CancelledError`` in both."""
    future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
    error: BaseException = TransferError("x") if end == "error" else _Stop()
    if end == "result":
        future.set_result(_result())
    elif end == "cancelled":
        future.cancel()
    else:
        future.set_exception(error)
    handle = BatchHandle(0, Direction.D2H, future)
    if end == "cancelled":
        for read in (_outcome, _two_reads):
            with pytest.raises(concurrent.futures.CancelledError):
                read(3, handle)
        return
    got, want = _outcome(3, handle), _two_reads(3, handle)
    assert attrs.asdict(got, recurse=False) == attrs.asdict(want, recurse=False)
    if end != "result":
        assert got.error is error and got.results == ()


class _Counts:
    """The transport's side of ``Flusher._submit``: ``Submitted`` counts chosen by the test."""

    def __init__(self) -> None:
        self.next: tuple[int, int, int, int] = (1, 1, 1, 1)

    def moved(self) -> None:
        return None

    def submit(self, job: Any, loop: Any, *, checked: bool = False) -> Submitted:
        return Submitted(None, *self.next)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_the_direction_reports_are_the_ones_built_from_the_counts(seed: int) -> None:
    """5. ``Flusher._submit``'s report: random counts from a few shapes (repeats too) give each
    time the report built from them, ints only."""
    rng, counts = random.Random(seed), _Counts()
    scheduler = SimpleNamespace(books=SimpleNamespace(counters=Counters()))
    flusher = Flusher(scheduler, None, None, lambda deliver: counts)  # type: ignore[arg-type]
    shapes = [tuple(rng.randint(0, 3) for _ in range(5)) for _ in range(192)]
    for _ in range(600):
        calls, *sub = rng.choice(shapes[:4] if rng.random() < 0.7 else shapes)
        counts.next = tuple(sub)  # type: ignore[assignment]
        job, lane = SimpleNamespace(num_blocks=sub[0]), SimpleNamespace(num_calls=calls)
        got = flusher._submit(job, lane, None)  # type: ignore[arg-type]
        want = DirectionReport(swaps=calls, blocks=sub[0], pages=sub[1], descriptors=sub[2],
                               bytes=sub[3], batches=1)  # fmt: skip
        assert got == want and all(type(v) is int for v in attrs.astuple(got))
