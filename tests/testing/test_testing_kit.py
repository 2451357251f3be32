"""The testing kit itself: FaultyEngine, VirtualClock, and check_invariants catching corruption."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import numpy as np
import pytest
import pytest_asyncio
import torch

from kvmgr import ClosedError, ConfigError, ManagerConfig, OffloadManager, TransferError
from kvmgr.manager import CpuState, GpuState, KeySnapshot
from kvmgr.pool.layout import KVLayout
from kvmgr.testing import (
    POISON_BYTE,
    FaultyEngine,
    InvariantError,
    NullEngine,
    ScriptedEngine,
    VirtualClock,
    check_invariants,
)
from kvmgr.transfer import HostEngine
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan

NUM_GPU, NUM_CPU = 12, 8


def _kv(seed: int = 0) -> list[torch.Tensor]:
    """Two irregular KV tensors (60 B dense pages; 27 B pages with a 40 B stride), random."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(NUM_GPU, 3, 5, generator=gen)
    strided = torch.randint(0, 256, (NUM_GPU, 40), generator=gen, dtype=torch.uint8)[:, :27]
    return [dense, strided]


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


class _Tiers:
    """A "GPU" and a "CPU" byte tier for driving an engine without a manager."""

    def __init__(self, seed: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gpu = torch.randint(0, 256, (NUM_GPU, 33), generator=gen, dtype=torch.uint8)
        self.cpu = torch.full((NUM_CPU, 33), 7, dtype=torch.uint8)
        self.gpu_layout = KVLayout.from_tensors([self.gpu])
        self.cpu_layout = KVLayout.from_tensors([self.cpu])

    def plan(self, direction: Direction, gpu_ids: list[int], cpu_ids: list[int]) -> TransferPlan:
        g, c = np.asarray(gpu_ids), np.asarray(cpu_ids)
        if direction is Direction.D2H:
            return build_plan(direction, self.gpu_layout, self.cpu_layout, g, c)
        return build_plan(direction, self.cpu_layout, self.gpu_layout, c, g)


def _wait(future: concurrent.futures.Future[object], timeout_s: float = 5.0) -> object:
    return future.result(timeout=timeout_s)


# ---------------------------------------------------------------------- FaultyEngine


def test_faulty_engine_copies_fails_and_poisons_failed_stores() -> None:
    tiers = _Tiers()
    engine = FaultyEngine(HostEngine(), fail_batches={1})
    try:
        ok = engine.submit(tiers.plan(Direction.D2H, [3, 4], [0, 1]))
        bad = engine.submit(tiers.plan(Direction.D2H, [5, 9], [2, 6]))
        _wait(ok.future)
        assert torch.equal(tiers.cpu[[0, 1]], tiers.gpu[[3, 4]])
        with pytest.raises(TransferError, match="batch 1"):
            _wait(bad.future)
        # the failed store's copy ran, and its destination was then poisoned
        assert (tiers.cpu[[2, 6]] == POISON_BYTE).all()
        assert (tiers.cpu[[3, 4, 5, 7]] == 7).all()  # nothing else touched
        assert engine.injected == {1: "fail"}
        assert engine.statistics().batches_failed == 1
    finally:
        engine.close()


def test_faulty_engine_failed_load_keeps_gpu_bytes_unpoisoned() -> None:
    tiers = _Tiers()
    tiers.cpu[:] = torch.arange(NUM_CPU, dtype=torch.uint8)[:, None] + 40
    engine = FaultyEngine(HostEngine(), fail_batches={0})
    try:
        handle = engine.submit(tiers.plan(Direction.H2D, [2], [5]))
        with pytest.raises(TransferError):
            _wait(handle.future)
        assert (tiers.gpu[2] == 45).all()  # a failed load's copy may have run
    finally:
        engine.close()


def test_hang_stalls_its_direction_only_until_release() -> None:
    tiers = _Tiers()
    original = tiers.gpu.clone()
    engine = FaultyEngine(HostEngine(), hang_batches={0})
    try:
        hung = engine.submit(tiers.plan(Direction.D2H, [1], [1]))
        behind = engine.submit(tiers.plan(Direction.D2H, [2], [2]))  # same stream: waits
        other = engine.submit(tiers.plan(Direction.H2D, [7], [5]))  # other stream: runs
        fenced = engine.submit(tiers.plan(Direction.H2D, [1], [3]), wait_for=[hung])
        _wait(other.future)
        time.sleep(0.05)
        assert not hung.done() and not behind.done() and not fenced.done()
        assert engine.waiting_batch_ids == [0, 1, 3]
        assert (tiers.cpu[[1, 2]] == 7).all()  # copies not started: nothing written
        assert [h.batch_id for h in engine.complete_next()] == [0]
        _wait(behind.future)
        _wait(fenced.future)
        assert hung.done() and engine.waiting_batch_ids == []
        # the fenced load overwrote GPU block 1 only after the hung store had read it
        assert torch.equal(tiers.cpu[[1, 2]], original[[1, 2]])
        assert (tiers.gpu[1] == 7).all() and torch.equal(tiers.gpu[7], tiers.cpu[5])
    finally:
        engine.close()


def test_hold_complete_next_in_order_and_fail_on_demand() -> None:
    tiers = _Tiers()
    engine = FaultyEngine(HostEngine())
    try:
        engine.hold()
        handles = [engine.submit(tiers.plan(Direction.D2H, [i], [i])) for i in range(3)]
        time.sleep(0.02)
        assert not any(h.done() for h in handles)
        engine.complete_next(fail=True)
        with pytest.raises(TransferError):
            _wait(handles[0].future)
        assert not handles[1].done()
        assert [h.batch_id for h in engine.release()] == [1, 2]
        for h in handles[1:]:
            _wait(h.future)
        later = engine.submit(tiers.plan(Direction.D2H, [5], [5]))  # release stops holding
        _wait(later.future)
        with pytest.raises(ValueError):
            engine.complete_next(-1)
    finally:
        engine.close()


def test_release_starts_every_batch_when_completions_are_synchronous() -> None:
    tiers = _Tiers()
    inner = NullEngine(record=True)  # completes every batch inside submit: callbacks inline
    engine = FaultyEngine(inner)
    engine.hold()
    handles = [engine.submit(tiers.plan(Direction.H2D, [i], [i])) for i in range(5)]
    assert not any(h.done() for h in handles)
    engine.release()
    assert all(h.done() for h in handles)
    assert [h.batch_id for _, _, h in inner.submitted] == [0, 1, 2, 3, 4]
    engine.close()


def test_fail_rate_is_seeded() -> None:
    def fates(seed: int) -> dict[int, str]:
        tiers = _Tiers()
        engine = FaultyEngine(HostEngine(), fail_rate=0.3, seed=seed)
        try:
            handles = [
                engine.submit(tiers.plan(Direction.D2H, [i % 5], [i % 5])) for i in range(60)
            ]
            concurrent.futures.wait([h.future for h in handles], timeout=5.0)
            assert all(h.done() for h in handles)
            failed = {h.batch_id for h in handles if h.future.exception() is not None}
            assert failed == set(engine.injected)
            return engine.injected
        finally:
            engine.close()

    first = fates(11)
    assert first == fates(11)
    assert first != fates(12)
    assert 5 <= len(first) <= 35


def test_fail_rate_can_spare_a_direction() -> None:
    tiers = _Tiers()
    engine = FaultyEngine(HostEngine(), fail_rate=1.0, fail_directions=(Direction.D2H,))
    try:
        store = engine.submit(tiers.plan(Direction.D2H, [1], [1]))
        load = engine.submit(tiers.plan(Direction.H2D, [2], [2]))
        _wait(load.future)
        with pytest.raises(TransferError):
            _wait(store.future)
        assert engine.injected == {0: "fail"}
    finally:
        engine.close()


def test_refused_batch_and_submit_after_close() -> None:
    tiers = _Tiers()
    engine = FaultyEngine(HostEngine(), refuse_batches={0})
    with pytest.raises(TransferError, match="refused"):
        engine.submit(tiers.plan(Direction.D2H, [1], [1]))
    _wait(engine.submit(tiers.plan(Direction.D2H, [1], [1])).future)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(ClosedError):
        engine.submit(tiers.plan(Direction.D2H, [1], [1]))


def test_refused_issue_end_events_and_stream_waits() -> None:
    """A batch whose issue is refused: its handle says so at submit, nothing is copied, it
    fails in order; end events stand in for a CUDA engine's; stream waits are recorded."""
    tiers = _Tiers()
    engine = ScriptedEngine(HostEngine(), refuse_issue_batches={1}, end_events=True)
    try:
        ok = engine.submit(tiers.plan(Direction.D2H, [1], [1]))
        refused = engine.submit(tiers.plan(Direction.D2H, [2], [2]))
        assert ok.refused is None and isinstance(refused.refused, TransferError)
        assert ok.end_event is not None and refused.end_event is not None
        with pytest.raises(TransferError, match="refused at issue"):
            _wait(refused.future)
        _wait(ok.future)
        assert torch.equal(tiers.cpu[1], tiers.gpu[1]) and (tiers.cpu[2] == 7).all()
        assert engine.injected == {1: "refuse_issue"}
        engine.stream_wait(ok)
        engine.stream_wait(refused, stream="other")
        assert engine.stream_waits == [0, 1]
    finally:
        engine.close()


def test_hooks_are_set_and_their_regions_closed_with_the_engine() -> None:
    closed: list[str] = []

    class Region:
        def close(self) -> None:
            closed.append("region")

    hooks = {"allocate_host_region": lambda layout: Region(), "plan_duplex": lambda d, h: (h, d)}
    engine = ScriptedEngine(HostEngine(), hooks=hooks)
    assert engine.plan_duplex(1, 2) == (2, 1)  # type: ignore[attr-defined]
    assert isinstance(engine.allocate_host_region(None), Region)  # type: ignore[attr-defined]
    assert not hasattr(ScriptedEngine(None), "plan_duplex")  # none given: the manager sees none
    engine.close()
    assert closed == ["region"]
    with pytest.raises(ConfigError, match="unknown engine hooks"):
        ScriptedEngine(None, hooks={"plan_duplx": lambda d2h, h2d: (d2h, h2d)})
    with pytest.raises(ConfigError, match="callable"):
        ScriptedEngine(None, hooks={"plan_duplex": 3})  # type: ignore[dict-item]


def test_delay_then_close_joins_its_thread_and_fails_unstarted_batches() -> None:
    tiers = _Tiers()
    engine = FaultyEngine(HostEngine(), delay_s=0.05, hang_batches={1})
    start = time.perf_counter()
    delayed = engine.submit(tiers.plan(Direction.D2H, [1], [1]))
    hung = engine.submit(tiers.plan(Direction.H2D, [2], [2]))
    _wait(delayed.future)
    assert time.perf_counter() - start >= 0.05
    assert any(t.name == "kvmgr-faulty-delay" for t in threading.enumerate())
    engine.close(timeout_s=1.0)
    with pytest.raises(ClosedError):
        _wait(hung.future)
    names = [t.name for t in threading.enumerate()]
    assert not any(n.startswith(("kvmgr-faulty", "kvmgr-host")) for n in names), names


@pytest.mark.parametrize(
    "kwargs", [{"fail_rate": 1.5}, {"fail_rate": -0.1}, {"delay_s": -1.0}, {"inner": object()}]
)
def test_faulty_engine_rejects_bad_settings(kwargs: dict[str, object]) -> None:
    inner = kwargs.pop("inner", None)
    engine = HostEngine()
    try:
        with pytest.raises(ConfigError):
            FaultyEngine(inner if inner is not None else engine, **kwargs)  # type: ignore[arg-type]
    finally:
        engine.close()


# ---------------------------------------------------------------------- VirtualClock


def test_virtual_clock_fires_timers_only_when_advanced() -> None:
    clock = VirtualClock(start_s=100.0)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert loop.time() == 100.0
        sleeper = asyncio.ensure_future(asyncio.sleep(10.0))
        never: asyncio.Future[None] = loop.create_future()
        timed = asyncio.ensure_future(asyncio.wait_for(never, 30.0))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not sleeper.done() and not timed.done()
        clock.advance(9.5)
        await asyncio.sleep(0)
        assert not sleeper.done()
        clock.advance(0.5)
        await sleeper
        assert not timed.done()
        clock.advance(20.0)
        with pytest.raises(asyncio.TimeoutError):
            await timed

    start = time.perf_counter()
    clock.run(main())
    assert time.perf_counter() - start < 2.0  # 30 virtual seconds in far less real time
    assert clock.time() == 130.0
    with pytest.raises(ValueError):
        clock.advance(-1.0)
    with pytest.raises(ValueError):
        clock.advance(float("nan"))
    for bad in ("1", None, True):
        with pytest.raises(TypeError, match="real number"):
            clock.advance(bad)  # type: ignore[arg-type]
    assert clock.time() == 130.0  # nothing moved


@pytest.mark.asyncio
async def test_virtual_clock_installs_on_a_running_loop_and_restores_it() -> None:
    loop = asyncio.get_running_loop()
    with VirtualClock().install(loop) as clock:
        start = loop.time()
        task = asyncio.ensure_future(asyncio.sleep(1000.0))
        await asyncio.sleep(0)
        clock.advance(1000.0)
        await task
        assert loop.time() == start + 1000.0
    assert abs(loop.time() - time.monotonic()) < 1.0  # the real clock is back


# ---------------------------------------------------------------------- check_invariants


@pytest_asyncio.fixture
async def scene() -> AsyncIterator[tuple[OffloadManager, FaultyEngine]]:
    """A manager with READY keys a..c, request "r" resident on 4 GPU blocks, and a held engine."""
    engine = FaultyEngine(HostEngine())
    mgr = OffloadManager(_kv(), ManagerConfig(num_cpu_blocks=NUM_CPU), engine=engine)
    async with mgr:
        ids = mgr.allocate("r", 4)
        store = mgr.swap_out(ids[:3], [b"a", b"b", b"c"])
        await mgr.step()
        await store
        check_invariants(mgr)  # positive control: a healthy manager passes
        engine.hold()
        yield mgr, engine
        engine.release()


def _broken(mgr: OffloadManager, match: str) -> None:
    with pytest.raises(InvariantError, match=match):
        check_invariants(mgr)


# Each bug below is seeded in the scene's manager by corrupting its private state directly (the
# Bookkeeper's state arrays, index, tables, allocators; the queue). A bug is an async generator:
# it seeds the bug and yields what check_invariants, which reads only snapshot() and
# statistics(), must say (a regex), one or more times (repairing or seeding more in between),
# then lets in-flight work end. Where the snapshot derives two views from one array (so no
# corruption of the arrays can make them disagree), the bug is seeded in snapshot() or
# statistics() themselves.

Bug = Callable[[OffloadManager], AsyncIterator[str]]
BUGS: list[Any] = []


def _bug(seed: Bug) -> Bug:
    BUGS.append(pytest.param(seed, id=seed.__name__.strip("_")))
    return seed


def _books(mgr: OffloadManager) -> Any:
    return mgr._books  # private: only to inject bugs


def _engine(mgr: OffloadManager) -> FaultyEngine:
    engine = mgr.engine
    assert isinstance(engine, FaultyEngine)
    return engine


def _cpu_block(mgr: OffloadManager, key: bytes) -> int:
    return mgr.snapshot().keys[key].cpu_block_id


# ---------------------------------------------------------------- CPU tier and key index


@_bug
async def _a_leaked_cpu_block(mgr: OffloadManager) -> AsyncIterator[str]:
    cpu = _books(mgr).cpu
    block = int(cpu.pool.take(1)[0])
    cpu.state_np[block] = CpuState.SWAPPED  # a block of no request, never given back
    yield f"CPU block {block} \\(SWAPPED\\) is allocated with no owner \\(leaked\\)"


@_bug
async def _a_cpu_block_allocated_but_free(mgr: OffloadManager) -> AsyncIterator[str]:
    block = int(_books(mgr).cpu.pool.take(1)[0])  # handed out, its state never set
    yield f"CPU block {block} is FREE but allocated=True"


@_bug
async def _a_ready_block_given_back(mgr: OffloadManager) -> AsyncIterator[str]:
    block = _cpu_block(mgr, b"b")
    _books(mgr).cpu.pool.give(np.array([block]))  # freed while its key still names it
    yield f"CPU block {block} is READY but allocated=False"
    yield f"CPU block {block} is in use but free in the allocator"


@_bug
async def _two_keys_on_one_block(mgr: OffloadManager) -> AsyncIterator[str]:
    index = _books(mgr).cpu.index
    index[b"c"] = index[b"a"]  # c's block is lost, a's is shared
    yield "CPU blocks with several owners"


@_bug
async def _index_policy_drift(mgr: OffloadManager) -> AsyncIterator[str]:
    mgr.policy.remove([b"b"])
    yield "index has 3 keys, policy 2; not in the policy"


@_bug
async def _a_key_on_an_unkeyed_block(mgr: OffloadManager) -> AsyncIterator[str]:
    block = _cpu_block(mgr, b"a")
    _books(mgr).cpu.state_np[block] = CpuState.RESUMING
    yield f"is on a RESUMING block {block}"


@_bug
async def _a_key_whose_block_state_differs(mgr: OffloadManager) -> AsyncIterator[str]:
    # a key's state and its block's state come from one array: seed the bug in snapshot()
    snapshot = mgr.snapshot
    block = _cpu_block(mgr, b"a")

    def stale() -> Any:
        snap = snapshot()
        keys = dict(snap.keys)
        keys[b"a"] = KeySnapshot(block, CpuState.PENDING, 0)
        return attrs.evolve(snap, keys=keys)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mgr, "snapshot", stale)
        yield f"block {block} state differs from the key's"


@_bug
async def _ready_while_store_in_flight(mgr: OffloadManager) -> AsyncIterator[str]:
    mgr.swap_out([mgr.block_table("r")[3][1]], [b"d"])
    await mgr.step()
    check_invariants(mgr)  # PENDING while held: fine
    cpu = _books(mgr).cpu
    cpu.state_np[_cpu_block(mgr, b"d")] = CpuState.READY  # READY before the copy ended
    cpu.num_pending -= 1
    yield "is READY while a store still writes its block"


@_bug
async def _pending_without_a_store(mgr: OffloadManager) -> AsyncIterator[str]:
    cpu = _books(mgr).cpu
    cpu.state_np[_cpu_block(mgr, b"b")] = CpuState.PENDING  # never readable again
    cpu.num_pending += 1
    yield "is PENDING with 0 stores in flight"


@_bug
async def _a_pinned_key_without_load(mgr: OffloadManager) -> AsyncIterator[str]:
    cpu = _books(mgr).cpu
    cpu.readers[_cpu_block(mgr, b"a")] += 1  # pinned for ever: never evictable
    cpu.num_loading += 1
    yield "has 1 readers, 0 loads"


@_bug
async def _a_pending_key_with_readers(mgr: OffloadManager) -> AsyncIterator[str]:
    mgr.swap_out([mgr.block_table("r")[3][1]], [b"d"])
    await mgr.step()
    cpu = _books(mgr).cpu
    cpu.readers[_cpu_block(mgr, b"d")] += 1  # a load admitted on a PENDING key
    cpu.num_loading += 1
    yield "is PENDING with readers"


@_bug
async def _a_moving_table_without_its_copy(mgr: OffloadManager) -> AsyncIterator[str]:
    _books(mgr).requests.tables["r"].moving = True
    yield "request 'r': moving=True with 0 preempts/resumes"


# ---------------------------------------------------------------- GPU blocks


@_bug
async def _busy_counts_without_copies(mgr: OffloadManager) -> AsyncIterator[str]:
    _books(mgr).gpu.busy[mgr.block_table("r")[0][1]] += 1  # a copy's end never released it
    yield "GPU busy counts differ from the unsettled copies"


@_bug
async def _a_gpu_block_free_in_a_table(mgr: OffloadManager) -> AsyncIterator[str]:
    gpu = _books(mgr).gpu
    block = mgr.block_table("r")[0][1]
    gpu.state_np[block] = GpuState.FREE  # back in the pool while the request still has it
    gpu.pool.give(np.array([block]))
    yield f"GPU block {block} is FREE but in .*request 'r'"


@_bug
async def _a_held_gpu_block_the_allocator_gave_back(mgr: OffloadManager) -> AsyncIterator[str]:
    block = mgr.block_table("r")[1][1]
    _books(mgr).gpu.pool.give(np.array([block]))  # the next allocate could hand it out again
    yield f"GPU block {block} is HELD but allocated=False"


@_bug
async def _a_gpu_block_held_twice(mgr: OffloadManager) -> AsyncIterator[str]:
    mgr.allocate("s", 1)
    tables = _books(mgr).requests.tables
    tables["s"].block_ids.append(tables["r"].block_ids[0])  # two requests write one block
    yield "GPU blocks held twice"


@_bug
async def _a_leaked_gpu_block(mgr: OffloadManager) -> AsyncIterator[str]:
    block = int(_books(mgr).gpu.allocate(1)[0])  # HELD, in no table
    yield f"GPU block {block} is HELD by no request and no resume \\(leaked\\)"


@_bug
async def _a_draining_block_without_a_copy(mgr: OffloadManager) -> AsyncIterator[str]:
    gpu = _books(mgr).gpu
    block = int(gpu.allocate(1)[0])
    gpu.state_np[block] = GpuState.DRAINING  # would never go back to the pool
    yield f"GPU block {block} is DRAINING with no copy using it"


@_bug
async def _a_gpu_block_free_under_a_copy(mgr: OffloadManager) -> AsyncIterator[str]:
    ids = mgr.allocate("s", 1)
    load = mgr.swap_in([b"a"], ids)
    await mgr.step()
    check_invariants(mgr)
    books = _books(mgr)
    del books.requests.tables["s"]  # the request's block goes back mid-copy, not DRAINING
    books.gpu.state_np[ids] = GpuState.FREE
    books.gpu.pool.give(np.array(ids))
    yield "is FREE while a queued or in-flight copy uses it"
    _engine(mgr).release()
    await load


# ---------------------------------------------------------------- futures, statistics, engine


@_bug
async def _a_future_resolved_early(mgr: OffloadManager) -> AsyncIterator[str]:
    load = mgr.swap_in([b"c"], [mgr.block_table("r")[3][1]])
    load.set_result(None)
    yield "a load's future resolved before its copy settled"
    await mgr.step()
    _engine(mgr).release()


@_bug
async def _pending_and_loading_counters_drift(mgr: OffloadManager) -> AsyncIterator[str]:
    cpu = _books(mgr).cpu
    cpu.num_pending += 1  # a completion that forgot to count down
    yield "statistics: 1 PENDING keys, snapshot 0"
    cpu.num_pending -= 1
    cpu.num_loading += 2
    yield "statistics: 2 keys loading, snapshot 0"


@_bug
async def _a_batch_the_manager_forgot(mgr: OffloadManager) -> AsyncIterator[str]:
    store = mgr.swap_out([mgr.block_table("r")[3][1]], [b"d"])
    await mgr.step()
    (batch,) = mgr.snapshot().batches
    queue = mgr._queue  # private: only to inject the bug
    lost = queue.in_flight.pop(batch.seq)  # its completion will find nothing to settle
    yield f"engine batches \\[{batch.engine_batch_id}\\] are unresolved but unknown"
    queue.in_flight[batch.seq] = lost
    _engine(mgr).release()
    await store


@_bug
async def _poison_served_as_ready(mgr: OffloadManager) -> AsyncIterator[str]:
    block = _cpu_block(mgr, b"b")
    for pages in mgr.cpu_pool.tensors:
        pages[block] = POISON_BYTE  # what a failed store leaves behind
    yield "READY keys hold the poison of a failed store"
    check_invariants(mgr, scan_poison=False)


@_bug
async def _a_missing_fence(mgr: OffloadManager) -> AsyncIterator[str]:
    block = mgr.block_table("r")[3][1]
    store = mgr.swap_out([block], [b"d"])
    await mgr.step()
    load = mgr.swap_in([b"a"], [block])  # must wait for the store that reads the block
    check_invariants(mgr)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mgr._queue, "fences", lambda *args: [])  # a manager bug
        await mgr.step()
        yield "share GPU blocks \\[" + str(block) + "\\] without a wait_for fence"
    _engine(mgr).release()
    await asyncio.gather(store, load)


@pytest.mark.parametrize("seed_bug", BUGS)
@pytest.mark.asyncio
async def test_invariants_catch(scene: tuple[OffloadManager, FaultyEngine], seed_bug: Bug) -> None:
    mgr, _ = scene
    said = 0
    async for match in seed_bug(mgr):
        _broken(mgr, match)
        said += 1
    assert said > 0  # every bug is checked at least once


@pytest.mark.parametrize(
    ("field", "match"),
    [
        ("batches_in_flight", "statistics: 1 batches in flight, snapshot has 0"),
        ("queued_swaps", "statistics: 1 queued swaps, snapshot has 0"),
        ("cpu_blocks_used", "statistics: cpu_blocks_used differs from the allocator"),
    ],
)
@pytest.mark.asyncio
async def test_invariants_catch_statistics_that_disagree(
    scene: tuple[OffloadManager, FaultyEngine],
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    match: str,
) -> None:
    mgr, _ = scene
    # these gauges are read from the same structures as the snapshot: seed the bug in
    # statistics() (a gauge counted wrong)
    statistics = mgr.statistics
    monkeypatch.setattr(
        mgr,
        "statistics",
        lambda: attrs.evolve(statistics(), **{field: getattr(statistics(), field) + 1}),
    )
    _broken(mgr, match)
