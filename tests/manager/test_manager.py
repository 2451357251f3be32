"""OffloadManager scenarios on real CPU tensors, narrated step by step with exact block ids.

The "GPU" KV cache is three CPU tensors with different page sizes (584 B, 1152 B, and the V half
of a fp32 K/V cache: 96 B pages 192 B apart), filled with seeded random data, never zeros.
Destinations are poisoned before loads. ``_scripted()`` is the testing kit's ``ScriptedEngine``
over the host engine: it copies on one worker thread, holds batches while the test says
``hold()``, fails chosen batches with ``TransferError`` and records what was submitted.

State is read through the public ``snapshot()`` and ``statistics()`` only. With the owned GPU
pool (the default) a keyed swap may name only held blocks (issue 11), so keyed scenarios first
hand every GPU block to a "serving" request (``_hold``); request-level scenarios allocate.
Policies insert the first key of a call as the most recent and evict the leaves of a chain
first (policy protocol v2): scenarios that narrate an LRU order store their keys one call each
(independent roots), which gives the order the narration states.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import pytest
import torch

from kvmgr import (
    BlockStateError,
    ClosedError,
    ConfigError,
    DirectionReport,
    HookReport,
    InvalidArgumentError,
    InvalidKeyError,
    ManagerConfig,
    OffloadManager,
    PoolExhaustedError,
    StepContext,
    SwapResult,
    Tier,
    TransferError,
    TransferTimeoutError,
    UnknownKeyError,
)
from kvmgr.manager import CpuState
from kvmgr.testing import ScriptedEngine, check_invariants
from kvmgr.transfer.host import HostEngine
from kvmgr.transfer.plan import Direction, TransferPlan

NUM_GPU = 8
K = [bytes([0x10 + i]) * 16 for i in range(8)]  # block keys K[0..7]


def _scripted(
    *, fail: Callable[[int, TransferPlan], bool] | None = None, **script: Any
) -> ScriptedEngine:
    """The host engine's copies (one worker thread), held while the test says ``hold()``,
    failing the batches ``fail(batch_id, plan)`` picks, recording every submission."""
    return ScriptedEngine(HostEngine(), fail_when=fail, record=True, name="scripted", **script)


async def _settled(engine: ScriptedEngine) -> None:
    """Wait (on the loop) until every submitted batch ended and the manager saw it."""
    for _, _, handle in engine.submitted:
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(handle.future)
    await asyncio.sleep(0)


def _kv(seed: int, nb: int = NUM_GPU) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv_pair = torch.randn(nb, 2, 4, 6, generator=gen)  # fp32 K/V halves
    return [
        torch.randint(1, 256, (nb, 584), dtype=torch.uint8, generator=gen),
        torch.randn(nb, 2, 288, generator=gen).to(torch.bfloat16),
        kv_pair[:, 1],  # non-dense: 96 B pages, 192 B apart
    ]


BLOCK_BYTES = 584 + 1152 + 96


def _gpu(kv: list[torch.Tensor], b: int) -> bytes:
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in kv)


def _cpu(mgr: OffloadManager, c: int) -> bytes:
    return b"".join(t[c].numpy().tobytes() for t in mgr.cpu_pool.tensors)


def _fill(kv: list[torch.Tensor], b: int, value: int | None = None, seed: int = 0) -> bytes:
    """Overwrite GPU block ``b``: with ``value`` (poison) or seeded random non-zero bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in kv:
        page = t[b].view(torch.uint8)
        if value is None:
            page.copy_(torch.randint(1, 256, page.shape, dtype=torch.uint8, generator=gen))
        else:
            page.fill_(value)
    return _gpu(kv, b)


def _cfg(num_cpu_blocks: int = 4, **kw: Any) -> ManagerConfig:
    return ManagerConfig(num_cpu_blocks=num_cpu_blocks, engine="host", **kw)


def _hold(mgr: OffloadManager) -> None:
    """A "serving" request holds every GPU block, so keyed swaps may name any of them."""
    assert mgr.allocate("serving", NUM_GPU) == list(range(NUM_GPU))


def _keys(mgr: OffloadManager) -> list[bytes]:
    """The keys of the CPU tier (any state), sorted."""
    return sorted(mgr.snapshot().keys)


def _entry(mgr: OffloadManager, key: bytes) -> Any:
    """The key's ``KeySnapshot`` (cpu_block_id, state, readers)."""
    return mgr.snapshot().keys[key]


def _cpu_free(mgr: OffloadManager) -> int:
    stats = mgr.statistics()
    return stats.cpu_blocks_total - stats.cpu_blocks_used


@contextlib.asynccontextmanager
async def _open(
    kv: list[torch.Tensor], cfg: ManagerConfig, **kw: Any
) -> AsyncIterator[OffloadManager]:
    """The manager, with the loop's exception handler watched: nothing may leak into it."""
    loop = asyncio.get_running_loop()
    leaked: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: leaked.append(context))
    engine = kw.get("engine")
    try:
        async with OffloadManager(kv, cfg, **kw) as mgr:
            try:
                yield mgr
            finally:
                if isinstance(engine, ScriptedEngine):
                    engine.release()  # a failing test must not leave copies held (aclose waits)
        gc.collect()  # "exception never retrieved" is reported on collection
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert leaked == []


@contextlib.asynccontextmanager
async def _serving(
    kv: list[torch.Tensor], cfg: ManagerConfig, **kw: Any
) -> AsyncIterator[OffloadManager]:
    """``_open``'s manager with every GPU block held by a "serving" request (``_hold``)."""
    async with _open(kv, cfg, **kw) as mgr:
        _hold(mgr)
        yield mgr


async def _swapped_out(mgr: OffloadManager, *args: Any) -> Any:
    """``mgr.swap_out(*args)``, stepped and awaited: its ``SwapResult``."""
    store = mgr.swap_out(*args)
    await mgr.step()
    return await store


async def _roots(
    mgr: OffloadManager, keys: Sequence[bytes], engine: ScriptedEngine | None = None
) -> None:
    """``keys[i]`` READY in CPU block ``i`` from GPU block ``i``; LRU order as ``keys`` (one
    call each: roots). With a holding ``engine``, its one batch is completed by
    ``complete_next`` (``release`` would stop holding)."""
    stores = [mgr.swap_out([b], [key]) for b, key in enumerate(keys)]
    await mgr.step()
    if engine is not None:
        assert len(engine.complete_next()) == 1
    await asyncio.gather(*stores)


def _snapshot(mgr: OffloadManager, req_ids: Sequence[Any] = ()) -> dict[str, Any]:
    """Everything a rejected call must leave unchanged (statistics less ``rejected``)."""
    stats = attrs.asdict(mgr.statistics())
    stats.pop("rejected")
    snap = mgr.snapshot()
    return {
        "stats": stats,
        "index": {k: (e.cpu_block_id, e.state, e.readers) for k, e in snap.keys.items()},
        "policy": sorted(snap.policy_keys),
        "lru": list(getattr(mgr.policy, "ordered_keys", list)()),
        "cpu": (snap.cpu_allocated, snap.cpu_states),
        "gpu": (snap.gpu_allocated, snap.gpu_states, dict(snap.gpu_busy)),
        "swaps": snap.swaps,
        "tables": {r: mgr.block_table(r) for r in req_ids},
    }


# ------------------------------------------------------------------ round trip and stores


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("merge", [True, False])
async def test_store_lookup_load_round_trip_with_verified_bytes(policy: str, merge: bool) -> None:
    kv = _kv(seed=1)
    originals = {b: _gpu(kv, b) for b in range(NUM_GPU)}
    async with _serving(kv, _cfg(policy=policy, merge=merge)) as mgr:
        # 1. store GPU blocks 2, 5, 6 under K0..K2: fresh CPU blocks 0, 1, 2 in order
        store = mgr.swap_out([2, 5, 6], keys=K[:3])
        assert mgr.lookup(K[:3]) == 0  # PENDING until the copy completes
        check_invariants(mgr)
        report = await mgr.step()
        assert await store == SwapResult(
            num_blocks=3,
            num_bytes=3 * BLOCK_BYTES,
            cpu_block_ids=(0, 1, 2),
            gpu_block_ids=(2, 5, 6),
        )
        check_invariants(mgr)
        assert report.d2h.blocks == 3 and report.h2d == DirectionReport()
        for c, b in zip((0, 1, 2), (2, 5, 6)):
            assert _cpu(mgr, c) == originals[b]
        # 2. lookup: the leading READY run; K3 was never stored
        assert mgr.lookup([*K[:3], K[3]]) == 3
        assert mgr.lookup([K[3], K[0]]) == 0
        # 3. poison GPU blocks 7, 0, 1 and load K0..K2 into them
        for b in (7, 0, 1):
            _fill(kv, b, value=0xA5)
        load = mgr.swap_in(K[:3], [7, 0, 1])
        assert _entry(mgr, K[0]).readers == 1
        check_invariants(mgr)
        await mgr.step()
        assert await load == SwapResult(
            num_blocks=3,
            num_bytes=3 * BLOCK_BYTES,
            cpu_block_ids=(0, 1, 2),
            gpu_block_ids=(7, 0, 1),
        )
        check_invariants(mgr)
        assert [_gpu(kv, b) for b in (7, 0, 1)] == [originals[2], originals[5], originals[6]]
        # 4. untouched blocks are untouched; readers are released
        assert [_gpu(kv, b) for b in (2, 3, 4, 5, 6)] == [originals[b] for b in (2, 3, 4, 5, 6)]
        assert all(_entry(mgr, k).readers == 0 for k in K[:3])
        stats = mgr.statistics()
        assert (stats.stores_completed, stats.loads_completed, stats.stores_failed) == (3, 3, 0)
        assert (stats.bytes_d2h, stats.bytes_h2d) == (3 * BLOCK_BYTES, 3 * BLOCK_BYTES)
        assert (stats.cpu_blocks_used, stats.cpu_keys_ready, stats.cpu_keys_pending) == (3, 3, 0)
        assert (stats.lookups, stats.lookup_keys, stats.lookup_hits) == (3, 9, 3)
        assert (stats.policy, stats.engine, stats.steps) == (policy, "host", 2)


@pytest.mark.asyncio
async def test_store_skips_keys_already_present_in_any_state() -> None:
    kv = _kv(seed=2)
    engine = _scripted()
    async with _serving(kv, _cfg(), engine=engine) as mgr:
        # 1. K0 stored from block 0 and READY
        await _swapped_out(mgr, [0], [K[0]])
        # 2. hold the engine: K1 stored from block 1 stays PENDING in flight
        engine.hold()
        second = mgr.swap_out([1], [K[1]])
        await mgr.step()
        assert _entry(mgr, K[1]).state is CpuState.PENDING
        # 3. store K0 (READY), K1 (PENDING) and K2 from other blocks: only K2 is copied
        third = mgr.swap_out([5, 6, 7], [K[0], K[1], K[2]])
        report = await mgr.step()
        assert report.d2h.blocks == 1 and report.d2h.swaps == 1
        engine.release()
        await second
        assert await third == SwapResult(
            num_blocks=1,
            num_bytes=BLOCK_BYTES,
            num_skipped=2,
            cpu_block_ids=(2,),
            gpu_block_ids=(7,),
        )
        # 4. the CPU copies of K0 and K1 still hold blocks 0 and 1, not 5 and 6
        assert (_cpu(mgr, 0), _cpu(mgr, 1), _cpu(mgr, 2)) == (_gpu(kv, 0), _gpu(kv, 1), _gpu(kv, 7))
        assert mgr.statistics().stores_skipped == 2


@pytest.mark.asyncio
async def test_store_of_only_present_keys_resolves_at_once_without_a_batch() -> None:
    kv = _kv(seed=3)
    async with _serving(kv, _cfg()) as mgr:
        await _swapped_out(mgr, [0, 1], K[:2])
        again = mgr.swap_out([2, 3], K[:2])
        assert again.done()  # nothing to copy: no queue entry, no step needed
        assert again.result() == SwapResult(num_blocks=0, num_bytes=0, num_skipped=2)
        assert mgr.statistics().queued_swaps == 0


@pytest.mark.asyncio
async def test_eviction_takes_ready_unread_lru_blocks_never_keys_of_the_call() -> None:
    kv = _kv(seed=4)
    async with _serving(kv, _cfg(num_cpu_blocks=4)) as mgr:
        # 1. fill the tier: K0..K3 in CPU blocks 0..3, LRU order K0 K1 K2 K3 (one call each:
        #    four roots; one call would chain them and insert K0 as the most recent)
        await _roots(mgr, K[:4])
        # 2. lookup(K1) makes K1 most recent: K0 K2 K3 K1
        assert mgr.lookup([K[1]]) == 1
        # 3. a queued load of K0 pins it (reader) and touches it: K2 K3 K1 K0
        _fill(kv, 7, value=0xA5)
        load = mgr.swap_in([K[0]], [7])
        # 4. store K2 (present, protected) + K4, K5: two victims in LRU order skipping K2 and
        #    the pinned K0: K3 then K1; their blocks 3, 1 are freed in that order and reused
        #    last-freed-first: K4 -> 1, K5 -> 3
        data4, data5 = _fill(kv, 4, seed=40), _fill(kv, 5, seed=50)
        store = mgr.swap_out([6, 4, 5], [K[2], K[4], K[5]])
        assert _keys(mgr) == sorted([K[0], K[2], K[4], K[5]])
        assert {k: _entry(mgr, k).cpu_block_id for k in (K[4], K[5])} == {K[4]: 1, K[5]: 3}
        assert mgr.statistics().evictions == 2
        check_invariants(mgr)
        await mgr.step()
        assert (await store).cpu_block_ids == (1, 3)
        await load
        # 5. the data: K0 loaded intact, K4 and K5 stored intact, K2 still the old block 2
        assert _gpu(kv, 7) == _cpu(mgr, 0) == _gpu(kv, 0)
        assert (_cpu(mgr, 1), _cpu(mgr, 3), _cpu(mgr, 2)) == (data4, data5, _gpu(kv, 2))
        assert mgr.lookup([K[0], K[2], K[4], K[5]]) == 4
        assert mgr.lookup([K[1]]) == mgr.lookup([K[3]]) == 0


@pytest.mark.asyncio
async def test_pending_and_read_blocks_are_not_evicted_and_exhaustion_changes_nothing() -> None:
    kv = _kv(seed=5)
    engine = _scripted()
    async with _serving(kv, _cfg(num_cpu_blocks=2), engine=engine) as mgr:
        # 1. K0 READY in CPU block 0
        await _swapped_out(mgr, [0], [K[0]])
        # 2. hold the engine: K1 PENDING in block 1; a load of K0 in flight (one reader)
        engine.hold()
        pending = mgr.swap_out([1], [K[1]])
        load = mgr.swap_in([K[0]], [6])
        await mgr.step()
        # 3. a store of K2 finds nothing evictable: typed error, nothing changed
        before = _snapshot(mgr)
        with pytest.raises(PoolExhaustedError) as info:
            mgr.swap_out([2], [K[2]])
        assert (info.value.needed, info.value.available, info.value.reason) == (1, 0, "cpu_full")
        assert _snapshot(mgr) == before
        assert mgr.statistics().rejected == {"cpu_full": 1}
        # 4. the copies end: K1 READY, K0 unread; a store of K2 now evicts the LRU: K1
        #    (the load touched K0 after K1 was inserted)
        engine.release()
        await pending
        await load
        store = mgr.swap_out([2], [K[2]])
        assert _keys(mgr) == sorted([K[0], K[2]])
        assert _entry(mgr, K[2]).cpu_block_id == 1
        await mgr.step()
        await store


@pytest.mark.asyncio
async def test_touch_order_via_lookup_decides_eviction() -> None:
    kv = _kv(seed=6)
    async with _serving(kv, _cfg(num_cpu_blocks=3)) as mgr:
        # 1. K0, K1, K2 in blocks 0, 1, 2 (LRU order K0 K1 K2: one call each, three roots)
        await _roots(mgr, K[:3])
        # 2. lookup(K0): K1 K2 K0; lookup([K2, K1]) walks in reverse, K2 ends most recent: K0 K1 K2
        assert mgr.lookup([K[0]]) == 1
        assert mgr.lookup([K[2], K[1]]) == 2
        assert mgr.policy.ordered_keys() == [K[0], K[1], K[2]]
        # 3. only the hits are touched: lookup([K1, K7, K0]) stops at K7, K0 is not touched
        assert mgr.lookup([K[1], K[7], K[0]]) == 1
        assert mgr.policy.ordered_keys() == [K[0], K[2], K[1]]
        # 4. K3 evicts K0 and takes block 0; K4 then evicts K2 and takes block 2
        s3 = mgr.swap_out([3], [K[3]])
        assert K[0] not in _keys(mgr) and _entry(mgr, K[3]).cpu_block_id == 0
        s4 = mgr.swap_out([4], [K[4]])
        assert K[2] not in _keys(mgr) and _entry(mgr, K[4]).cpu_block_id == 2
        await mgr.step()
        await asyncio.gather(s3, s4)
        assert (_cpu(mgr, 0), _cpu(mgr, 2)) == (_gpu(kv, 3), _gpu(kv, 4))


# ------------------------------------------------------------------ failures


@pytest.mark.asyncio
async def test_failed_store_removes_only_blocks_not_yet_ready() -> None:
    kv = _kv(seed=7)
    engine = _scripted(fail=lambda batch_id, plan: batch_id == 1)
    async with _serving(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        # 1. batch 0: K0, K1 stored in CPU blocks 0, 1 (READY)
        await _swapped_out(mgr, [0, 1], K[:2])
        # 2. batch 1 fails: store of K0 (present, skipped), K2, K3 into blocks 2, 3
        bad = mgr.swap_out([4, 2, 3], [K[0], K[2], K[3]])
        await mgr.step()
        with pytest.raises(TransferError, match="injected fault"):
            await bad
        # 3. K2, K3 are gone and their blocks free; K0, K1 stay READY with their bytes
        assert _keys(mgr) == sorted(K[:2])
        assert all(_entry(mgr, k).state is CpuState.READY for k in K[:2])
        assert sorted(k for k in K if k in mgr.policy) == sorted(K[:2])
        check_invariants(mgr)
        assert (_cpu(mgr, 0), _cpu(mgr, 1)) == (_gpu(kv, 0), _gpu(kv, 1))
        stats = mgr.statistics()
        assert (stats.stores_failed, stats.cpu_blocks_used, stats.cpu_keys_pending) == (2, 2, 0)
        # 4. the freed blocks (one batch) are reused smallest first: 2, then 3
        retry = mgr.swap_out([2, 3], [K[2], K[3]])
        await mgr.step()
        assert (await retry).cpu_block_ids == (2, 3)


@pytest.mark.asyncio
async def test_a_failed_batch_fails_every_swap_in_it() -> None:
    kv = _kv(seed=28)
    engine = _scripted(fail=lambda batch_id, plan: batch_id >= 1)
    async with _serving(kv, _cfg(num_cpu_blocks=6), engine=engine) as mgr:
        # 1. batch 0: K0, K1 READY in CPU blocks 0, 1
        await _swapped_out(mgr, [0, 1], K[:2])
        # 2. one step, two stores (one batch) and two loads (one batch); both batches fail
        stores = [mgr.swap_out([2], [K[2]]), mgr.swap_out([3, 4], K[3:5])]
        loads = [mgr.swap_in([K[0]], [6]), mgr.swap_in([K[1], K[0]], [7, 5])]
        report = await mgr.step()
        assert (report.d2h.batches, report.h2d.batches) == (1, 1)
        results = await asyncio.gather(*stores, *loads, return_exceptions=True)
        assert all(isinstance(r, TransferError) for r in results)
        # 3. every store rolled back, every reader released
        assert _keys(mgr) == sorted(K[:2])
        assert [_entry(mgr, k).readers for k in K[:2]] == [0, 0]
        check_invariants(mgr)
        stats = mgr.statistics()
        assert (stats.stores_failed, stats.loads_failed, stats.cpu_blocks_used) == (3, 3, 2)


@pytest.mark.asyncio
async def test_failed_load_releases_the_reader() -> None:
    kv = _kv(seed=8)
    engine = _scripted(fail=lambda batch_id, plan: plan.direction is Direction.H2D)
    async with _serving(kv, _cfg(num_cpu_blocks=1), engine=engine) as mgr:
        await _swapped_out(mgr, [0], [K[0]])
        load = mgr.swap_in([K[0]], [5])
        await mgr.step()
        with pytest.raises(TransferError):
            await load
        assert _entry(mgr, K[0]).readers == 0
        assert mgr.statistics().loads_failed == 1
        # K0 is evictable again: a store of K1 evicts it
        await _swapped_out(mgr, [1], [K[1]])
        assert _keys(mgr) == [K[1]]


@pytest.mark.asyncio
async def test_swap_in_of_pending_or_unknown_key_raises_and_changes_nothing() -> None:
    kv = _kv(seed=9)
    engine = _scripted()
    async with _serving(kv, _cfg(), engine=engine) as mgr:
        engine.hold()
        store = mgr.swap_out([0], [K[0]])
        before = _snapshot(mgr)
        with pytest.raises(BlockStateError, match=K[0].hex()[:16]):
            mgr.swap_in([K[0]], [3])
        with pytest.raises(UnknownKeyError):
            mgr.swap_in([K[5], K[0]], [3, 4])
        assert _snapshot(mgr) == before
        await mgr.step()
        engine.release()
        await store


# ------------------------------------------------------------------ request level


@pytest.mark.asyncio
async def test_preempt_and_resume_with_the_owned_gpu_pool() -> None:
    kv = _kv(seed=10)
    engine = _scripted()
    async with _open(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        # 1. request r gets fresh GPU blocks 0, 1, 2
        assert mgr.allocate("r", 3) == [0, 1, 2]
        data = [_fill(kv, b, seed=100 + b) for b in (0, 1, 2)]
        # 2. preempt r with the engine held: the GPU blocks are not free until the copy ends
        engine.hold()
        preempt = mgr.preempt("r")
        await mgr.step()
        assert mgr.statistics().gpu_blocks_free == 5
        assert mgr.block_table("r") == [(Tier.GPU, 0), (Tier.GPU, 1), (Tier.GPU, 2)]
        assert mgr.is_moving("r")
        check_invariants(mgr)
        with pytest.raises(BlockStateError):
            mgr.resume("r")  # moving
        assert mgr.allocate("s", 5) == [3, 4, 5, 6, 7]
        with pytest.raises(PoolExhaustedError):
            mgr.allocate("t", 1)  # blocks 0-2 are still being read
        # 3. the copy completes: r is in CPU blocks 0-2, GPU 0-2 freed
        engine.release()
        # (a preempt's gpu_block_ids are the GPU blocks it gave back)
        assert await preempt == SwapResult(
            num_blocks=3,
            num_bytes=3 * BLOCK_BYTES,
            cpu_block_ids=(0, 1, 2),
            gpu_block_ids=(0, 1, 2),
        )
        assert mgr.block_table("r") == [(Tier.CPU, 0), (Tier.CPU, 1), (Tier.CPU, 2)]
        assert mgr.statistics().gpu_blocks_free == 3 and not mgr.is_moving("r")
        assert [_cpu(mgr, c) for c in (0, 1, 2)] == data
        # 4. poison the freed blocks, resume: fresh ids are used up, so the freed ones come back
        #    as the batch they were freed in, smallest first: 0, 1, 2
        for b in (0, 1, 2):
            _fill(kv, b, value=0xA5)
        resume = mgr.resume("r")
        await mgr.step()
        assert (await resume).gpu_block_ids == (0, 1, 2)
        assert mgr.block_table("r") == [(Tier.GPU, 0), (Tier.GPU, 1), (Tier.GPU, 2)]
        assert [_gpu(kv, b) for b in (0, 1, 2)] == data
        assert _cpu_free(mgr) == 4 and mgr.statistics().gpu_blocks_free == 0
        check_invariants(mgr)
        # 5. free returns r's blocks to the pool
        mgr.free("r")
        assert mgr.statistics().gpu_blocks_free == 3


@pytest.mark.asyncio
async def test_freed_blocks_still_being_copied_go_back_only_when_the_copy_ends() -> None:
    kv = _kv(seed=29)
    engine = _scripted()
    async with _open(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        # 1. r owns GPU 0, 1; a store of both is submitted and held by the engine
        mgr.allocate("r", 2)
        data = [_gpu(kv, 0), _gpu(kv, 1)]
        engine.hold()
        store = mgr.swap_out([0, 1], K[:2])
        await mgr.step()
        # 2. r is freed while the copy reads its blocks: they do not go back yet
        mgr.free("r")
        assert mgr.statistics().gpu_blocks_free == 6
        snap = mgr.snapshot()
        assert snap.gpu_states is not None
        assert [snap.gpu_states[b].name for b in (0, 1)] == ["DRAINING", "DRAINING"]
        check_invariants(mgr)
        assert mgr.allocate("s", 6) == [2, 3, 4, 5, 6, 7]
        with pytest.raises(PoolExhaustedError):
            mgr.allocate("t", 1)
        # 3. the copy ends: the stored bytes are r's, and 0, 1 return (one batch: smallest first)
        engine.release()
        await store
        assert [_cpu(mgr, 0), _cpu(mgr, 1)] == data
        assert mgr.statistics().gpu_blocks_free == 2
        assert mgr.allocate("t", 2) == [0, 1]


@pytest.mark.asyncio
async def test_preempt_and_resume_with_caller_owned_blocks() -> None:
    kv = _kv(seed=11)
    async with _open(kv, _cfg(num_cpu_blocks=3, manage_gpu_blocks=False)) as mgr:
        # 1. the caller registers GPU blocks 6, 3 for r; the manager owns no pool
        mgr.append_blocks("r", [6, 3])
        with pytest.raises(ConfigError):
            mgr.allocate("r", 1)
        data = [_gpu(kv, 6), _gpu(kv, 3)]
        # 2. preempt hands 6, 3 back to the caller once copied into CPU blocks 0, 1
        preempt = mgr.preempt("r")
        await mgr.step()
        assert (await preempt).gpu_block_ids == (6, 3)
        assert mgr.block_table("r") == [(Tier.CPU, 0), (Tier.CPU, 1)]
        assert mgr.statistics().gpu_blocks_free is None
        # 3. resume into caller-chosen blocks 1, 4 (poisoned first)
        _fill(kv, 1, value=0xA5)
        _fill(kv, 4, value=0xA5)
        resume = mgr.resume("r", [1, 4])
        await mgr.step()
        assert (await resume).gpu_block_ids == (1, 4)
        assert mgr.block_table("r") == [(Tier.GPU, 1), (Tier.GPU, 4)]
        assert [_gpu(kv, 1), _gpu(kv, 4)] == data
        assert _cpu_free(mgr) == 3


@pytest.mark.asyncio
async def test_failed_preempt_and_failed_resume_roll_back() -> None:
    kv = _kv(seed=12)
    failing = {"on": True}
    engine = _scripted(fail=lambda batch_id, plan: failing["on"])
    async with _open(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        # 1. a failed preempt leaves r resident with the same blocks; CPU blocks are freed
        mgr.allocate("r", 2)
        preempt = mgr.preempt("r")
        await mgr.step()
        with pytest.raises(TransferError):
            await preempt
        assert mgr.block_table("r") == [(Tier.GPU, 0), (Tier.GPU, 1)]
        assert _cpu_free(mgr) == 4
        # 2. a working preempt, then a failed resume: r stays in CPU, the new GPU blocks return
        failing["on"] = False
        preempt = mgr.preempt("r")
        await mgr.step()
        await preempt
        failing["on"] = True
        free_before = mgr.statistics().gpu_blocks_free
        resume = mgr.resume("r")
        await mgr.step()
        with pytest.raises(TransferError):
            await resume
        # (the failed preempt freed CPU blocks 0, 1, but fresh ids 2, 3 come first)
        assert mgr.block_table("r") == [(Tier.CPU, 2), (Tier.CPU, 3)]
        assert mgr.statistics().gpu_blocks_free == free_before
        check_invariants(mgr)
        stats = mgr.statistics()
        assert (stats.stores_failed, stats.loads_failed) == (2, 2)


# ------------------------------------------------------------------ flushing and reports


@pytest.mark.asyncio
async def test_tick_flush_mode_needs_no_step() -> None:
    kv = _kv(seed=13)
    async with _serving(kv, _cfg(num_cpu_blocks=4, flush="tick")) as mgr:
        # 1. three stores queued in one tick become one batch, without step()
        futures = [mgr.swap_out([b], [K[b]]) for b in (0, 1, 2)]
        results = await asyncio.gather(*futures)
        assert [r.cpu_block_ids for r in results] == [(0,), (1,), (2,)]
        assert mgr.engine.statistics().batches_submitted == 1
        # 2. a load round trip, still without step()
        _fill(kv, 7, value=0xA5)
        assert (await mgr.swap_in([K[1]], [7])).gpu_block_ids == (7,)
        assert _gpu(kv, 7) == _gpu(kv, 1)
        assert mgr.statistics().steps == 0


@pytest.mark.asyncio
async def test_one_plan_per_direction_per_step() -> None:
    kv = _kv(seed=14)
    async with _serving(kv, _cfg(num_cpu_blocks=8)) as mgr:
        # 1. K0, K1 stored in CPU blocks 0, 1
        await _swapped_out(mgr, [0, 1], K[:2])
        # 2. three stores and two loads, no shared GPU block, in one step
        stores = [
            mgr.swap_out([2, 3], K[2:4]),
            mgr.swap_out([4], [K[4]]),
            mgr.swap_out([6], [K[5]]),
        ]
        loads = [mgr.swap_in(K[:2], [0, 1]), mgr.swap_in([K[0]], [7])]
        report = await mgr.step()
        # D2H pairs 2->2, 3->3, 4->4, 6->5: runs [2-4] and [6]; 2 dense tensors x 2 runs
        # + 4 pages of the non-dense tensor = 8 descriptors
        assert report.d2h == DirectionReport(
            swaps=3, blocks=4, pages=12, descriptors=8, bytes=4 * BLOCK_BYTES, batches=1
        )
        # H2D pairs 0->0, 0->7, 1->1 (sorted by source): no run merges: 9 descriptors
        assert report.h2d == DirectionReport(
            swaps=2, blocks=3, pages=9, descriptors=9, bytes=3 * BLOCK_BYTES, batches=1
        )
        assert report.step == 2 and report.host_s >= 0
        await asyncio.gather(*stores, *loads)
        # 3. the next step reports the two batches completed since the last one
        report = await mgr.step(StepContext(step=41))
        assert report.step == 41
        assert sorted((r.direction.value, r.num_bytes) for r in report.completed) == [
            ("d2h", 4 * BLOCK_BYTES),
            ("h2d", 3 * BLOCK_BYTES),
        ]
        assert report.d2h == report.h2d == DirectionReport()


@pytest.mark.asyncio
async def test_store_then_load_of_one_gpu_block_in_one_step_is_ordered() -> None:
    kv = _kv(seed=15)
    engine = _scripted()
    async with _serving(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        # 1. J stored from block 5
        store = mgr.swap_out([5], [K[7]])
        await mgr.step()
        await store
        old3, new = _gpu(kv, 3), _gpu(kv, 5)
        # 2. same step: store block 3 under K0, then load J into block 3
        store, load = mgr.swap_out([3], [K[0]]), mgr.swap_in([K[7]], [3])
        report = await mgr.step()
        await asyncio.gather(store, load)
        # 3. two batches in two generations: the load waits for the store
        (p1, w1, h1), (p2, w2, _) = engine.submitted[1:]
        assert (p1.direction, p2.direction) == (Direction.D2H, Direction.H2D)
        assert w1 == () and w2 == (h1,)
        assert (report.d2h.batches, report.h2d.batches) == (1, 1)
        # 4. the store saw the old bytes; the block now holds J
        assert _cpu(mgr, 1) == old3 and _gpu(kv, 3) == new


@pytest.mark.asyncio
async def test_load_then_store_of_one_gpu_block_in_one_step_is_ordered() -> None:
    kv = _kv(seed=16)
    engine = _scripted()
    async with _serving(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        store = mgr.swap_out([5], [K[7]])
        await mgr.step()
        await store
        # 1. same step: load J into block 4, then store block 4 under K1: the store comes second
        load, store = mgr.swap_in([K[7]], [4]), mgr.swap_out([4], [K[1]])
        await mgr.step()
        await asyncio.gather(store, load)
        assert [p.direction for p, _, _ in engine.submitted[1:]] == [Direction.H2D, Direction.D2H]
        # 2. so the store saw J's bytes
        assert _cpu(mgr, 1) == _gpu(kv, 5) == _gpu(kv, 4)


@pytest.mark.asyncio
async def test_two_loads_into_one_block_in_one_step_become_two_ordered_batches() -> None:
    kv = _kv(seed=17)
    async with _serving(kv, _cfg(num_cpu_blocks=4)) as mgr:
        await _swapped_out(mgr, [1, 2], K[:2])
        first, second = mgr.swap_in([K[0]], [6]), mgr.swap_in([K[1]], [6])
        report = await mgr.step()
        await asyncio.gather(first, second)
        assert (report.h2d.batches, report.h2d.swaps) == (2, 2)
        assert _gpu(kv, 6) == _gpu(kv, 2)  # the later load wins


# ------------------------------------------------------------------ cancellation, waiting, backpressure


@pytest.mark.asyncio
async def test_cancelled_awaiter_leaves_the_copy_and_bookkeeping_intact() -> None:
    kv = _kv(seed=18)
    engine = _scripted()
    async with _serving(kv, _cfg(num_cpu_blocks=4), engine=engine) as mgr:
        # 1. a task awaits a store; cancel it before the step
        store = mgr.swap_out([2], [K[0]])
        task = asyncio.ensure_future(_await(store))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # 2. step: the copy runs; once it ended the key is READY with the right bytes
        await mgr.step()
        await _settled(engine)
        assert _entry(mgr, K[0]).state is CpuState.READY
        assert _cpu(mgr, 0) == _gpu(kv, 2)
        # 3. same for a load: the reader is released and the bytes arrive
        _fill(kv, 6, value=0xA5)
        load = mgr.swap_in([K[0]], [6])
        task = asyncio.ensure_future(_await(load))
        await asyncio.sleep(0)
        task.cancel()
        await mgr.step()
        await _settled(engine)
        assert _entry(mgr, K[0]).readers == 0
        assert _gpu(kv, 6) == _gpu(kv, 2)
        check_invariants(mgr)
        stats = mgr.statistics()
        assert (stats.stores_completed, stats.loads_completed, stats.batches_in_flight) == (1, 1, 0)


async def _await(future: asyncio.Future[Any]) -> Any:
    return await future


@pytest.mark.asyncio
async def test_wait_times_out_while_the_blocks_stay_fenced() -> None:
    kv = _kv(seed=19)
    engine = _scripted()
    async with _serving(kv, _cfg(num_cpu_blocks=1), engine=engine) as mgr:
        # 1. the engine holds the store of K0
        engine.hold()
        store = mgr.swap_out([0], [K[0]])
        await mgr.step()
        with pytest.raises(TransferTimeoutError):
            await mgr.wait(store, timeout_s=0.001)
        # 2. K0 stays PENDING: not readable, not evictable, and the store was not cancelled
        assert not store.done()
        assert mgr.lookup([K[0]]) == 0
        with pytest.raises(PoolExhaustedError):
            mgr.swap_out([1], [K[1]])
        # (core v2 counts await timeouts in their own field, not under rejected)
        stats = mgr.statistics()
        assert (stats.rejected, stats.await_timeouts) == ({"cpu_full": 1}, 1)
        # 3. the copy ends: the same future resolves and K0 is READY
        engine.release()
        assert (await mgr.wait(store, timeout_s=20)).cpu_block_ids == (0,)
        assert mgr.lookup([K[0]]) == 1


@contextlib.asynccontextmanager
async def _full_of_pinned_keys(
    kv: list[torch.Tensor],
) -> AsyncIterator[tuple[OffloadManager, ScriptedEngine, asyncio.Future[Any]]]:
    """A ``backpressure="wait"`` manager (60 s) whose 2-block tier K0, K1 fill, both pinned by
    loads held in flight: yields it, its held engine and the loads' future."""
    engine = _scripted()
    cfg = _cfg(num_cpu_blocks=2, backpressure="wait", store_wait_s=60.0)
    async with _serving(kv, cfg, engine=engine) as mgr:
        await _swapped_out(mgr, [0, 1], K[:2])
        engine.hold()
        load = mgr.swap_in(K[:2], [4, 5])
        await mgr.step()
        yield mgr, engine, load


@pytest.mark.asyncio
async def test_backpressure_wait_store_proceeds_when_a_load_finishes() -> None:
    kv = _kv(seed=20)
    async with _full_of_pinned_keys(kv) as (mgr, engine, load):
        # 2. a store of K2 finds no room and waits instead of raising
        waiting = mgr.swap_out([2], [K[2]])
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and mgr.statistics().queued_swaps == 0
        # 3. the loads end: room appears (the load touched K0 last, so K1 is the LRU victim)
        engine.release()
        await load
        for _ in range(100):  # the woken store queues itself within a few loop iterations
            if mgr.statistics().queued_swaps:
                break
            await asyncio.sleep(0)
        assert mgr.statistics().queued_swaps == 1
        await mgr.step()
        assert (await waiting).cpu_block_ids == (1,)
        assert _keys(mgr) == sorted([K[0], K[2]])
        assert _cpu(mgr, 1) == _gpu(kv, 2)


@pytest.mark.asyncio
async def test_backpressure_wait_times_out_with_reason_timeout() -> None:
    kv = _kv(seed=21)
    cfg = _cfg(num_cpu_blocks=1, backpressure="wait", store_wait_s=0.0)
    async with _serving(kv, cfg) as mgr:
        await _swapped_out(mgr, [0], [K[0]])
        load = mgr.swap_in([K[0]], [3])  # queued, never stepped before the timeout
        before = _snapshot(mgr)
        with pytest.raises(PoolExhaustedError) as info:
            await mgr.swap_out([1], [K[1]])
        assert info.value.reason == "timeout"
        assert _snapshot(mgr) == before
        assert mgr.statistics().rejected == {"timeout": 1}
        await mgr.step()
        await load


@pytest.mark.asyncio
async def test_backpressure_wait_cancelled_store_and_bad_input() -> None:
    kv = _kv(seed=26)
    async with _full_of_pinned_keys(kv) as (mgr, engine, load):
        # 1. bad input still raises at once in wait mode
        with pytest.raises(InvalidKeyError):
            mgr.swap_out([6], K[5])
        # 2. a waiting store is cancelled: nothing was queued, nothing changes
        before = _snapshot(mgr)
        waiting = mgr.swap_out([2], [K[2]])
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert _snapshot(mgr) == before
        # 3. the loads end; nothing retries the cancelled store
        engine.release()
        await load
        await mgr.step()
        assert _keys(mgr) == sorted(K[:2]) and mgr.statistics().queued_swaps == 0


@pytest.mark.asyncio
async def test_aclose_fails_a_waiting_store_without_evicting_for_it() -> None:
    kv = _kv(seed=27)
    engine = _scripted()
    mgr = OffloadManager(
        kv, _cfg(num_cpu_blocks=2, backpressure="wait", store_wait_s=60.0), engine=engine
    )
    async with mgr:
        _hold(mgr)
        # 1. K0, K1 fill the tier; loads of both held in flight; a store of K2 waits for room
        await _swapped_out(mgr, [0, 1], K[:2])
        engine.hold()
        load = mgr.swap_in(K[:2], [4, 5])
        await mgr.step()
        waiting = mgr.swap_out([2], [K[2]])
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_soon(engine.release)
    # 2. closing fails the waiting store; the loads completed; K0 and K1 are both still there
    await load
    with pytest.raises(ClosedError):
        await waiting
    assert _keys(mgr) == sorted(K[:2])
    assert mgr.statistics().evictions == 0


# ------------------------------------------------------------------ close and hooks


@pytest.mark.asyncio
async def test_aclose_fails_queued_swaps_and_finishes_those_in_flight() -> None:
    kv = _kv(seed=22)
    engine = _scripted()
    mgr = OffloadManager(kv, _cfg(num_cpu_blocks=4), engine=engine)
    async with mgr:
        _hold(mgr)
        await _swapped_out(mgr, [0], [K[0]])
        # 1. in flight: a store of K1 held by the engine; queued: a store of K2 and a load of K0
        engine.hold()
        in_flight = mgr.swap_out([1], [K[1]])
        await mgr.step()
        queued_store, queued_load = mgr.swap_out([2], [K[2]]), mgr.swap_in([K[0]], [5])
        asyncio.get_running_loop().call_soon(engine.release)  # released while aclose waits
    # 2. leaving the block closed it: queued swaps failed, the copy in flight completed
    assert mgr.closed
    for future in (queued_store, queued_load):
        with pytest.raises(ClosedError):
            await future
    assert (await in_flight).cpu_block_ids == (1,)
    assert _keys(mgr) == sorted(K[:2])
    assert _entry(mgr, K[0]).readers == 0 and _cpu_free(mgr) == 2
    check_invariants(mgr)
    # 3. use after close raises ClosedError; closing again is a no-op
    with pytest.raises(ClosedError):
        mgr.swap_out([3], [K[3]])
    with pytest.raises(ClosedError):
        mgr.swap_in([K[0]], [3])
    with pytest.raises(ClosedError):
        await mgr.step()
    await mgr.aclose()
    mgr.close()


@pytest.mark.asyncio
async def test_sync_close_fails_queued_swaps() -> None:
    kv = _kv(seed=23)
    mgr = OffloadManager(kv, _cfg())
    assert mgr.allocate("r", 1) == [0]  # owned pool: the store may name only a held block
    store = mgr.swap_out([0], [K[0]])
    preempt = mgr.preempt("r")
    mgr.close()
    for future in (store, preempt):
        with pytest.raises(ClosedError):
            await future
    assert _keys(mgr) == [] and _cpu_free(mgr) == 4
    assert mgr.block_table("r") == [(Tier.GPU, 0)]
    check_invariants(mgr)
    with pytest.raises(ClosedError):
        mgr.preempt("r")


@attrs.define
class _WriteHook:
    """Writes ``value`` into GPU block ``block`` of every KV tensor and records the call."""

    name: str
    kv: list[torch.Tensor]
    block: int
    value: int
    calls: list[tuple[str, int | None]]

    def __call__(self, ctx: StepContext) -> HookReport:
        self.calls.append((self.name, ctx.step))
        _fill(self.kv, self.block, value=self.value)
        return HookReport(name=self.name, launches=1)


@pytest.mark.asyncio
async def test_hooks_run_in_order_before_the_flush() -> None:
    kv = _kv(seed=24)
    calls: list[tuple[str, int | None]] = []
    hooks = [_WriteHook("a", kv, 3, 0x11, calls), _WriteHook("b", kv, 3, 0x22, calls)]
    async with _serving(kv, _cfg(), hooks=hooks) as mgr:
        # 1. a store of block 3 is queued before the step in which the hooks write block 3
        store = mgr.swap_out([3], [K[0]])
        report = await mgr.step(StepContext(step=7))
        await store
        # 2. hooks ran in order with the context; the store saw the last hook's bytes
        assert calls == [("a", 7), ("b", 7)]
        assert [h.name for h in report.hooks] == ["a", "b"]
        assert _cpu(mgr, 0) == bytes([0x22]) * BLOCK_BYTES


@pytest.mark.asyncio
async def test_a_failing_hook_leaves_the_queue_untouched() -> None:
    kv = _kv(seed=25)

    @attrs.define
    class _FailsOnce:
        name: str = "fails-once"
        calls: int = 0

        def __call__(self, ctx: StepContext) -> HookReport:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("hook failed")
            return HookReport(name=self.name)

    async with _serving(kv, _cfg(), hooks=[_FailsOnce()]) as mgr:
        # 1. the hook raises: step() raises it, nothing was submitted
        store = mgr.swap_out([0], [K[0]])
        with pytest.raises(RuntimeError, match="hook failed"):
            await mgr.step()
        stats = mgr.statistics()
        assert (stats.queued_swaps, stats.batches_in_flight) == (1, 0) and not store.done()
        # 2. the next step runs the hook and submits the store
        report = await mgr.step()
        assert report.d2h.swaps == 1
        assert (await store).cpu_block_ids == (0,)


@pytest.mark.asyncio
async def test_an_async_hook_is_refused_without_a_never_awaited_warning() -> None:
    """An ``async def`` hook returns a coroutine: step() raises the typed error and closes it
    (no "coroutine ... was never awaited" RuntimeWarning on top)."""
    import gc
    import warnings

    kv = _kv(seed=26)

    class _AsyncHook:
        name = "async-hook"

        async def __call__(self, ctx: StepContext) -> HookReport:
            return HookReport(name=self.name)

    async with _serving(kv, _cfg(), hooks=[_AsyncHook()]) as mgr:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(InvalidArgumentError, match="is it async"):
                await mgr.step()
            gc.collect()
        assert not [w for w in seen if "never awaited" in str(w.message)]


# ------------------------------------------------------------------ issue 20: stuck states


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "reuse"])
@pytest.mark.asyncio
async def test_root_invalidated_and_stored_again_keeps_index_and_policy_in_step(
    policy: str,
) -> None:
    kv = _kv(seed=40)
    async with _serving(kv, _cfg(num_cpu_blocks=4, policy=policy)) as mgr:
        # 1. a chain K0 <- K1 is stored; its root K0 is invalidated (K1 stays), then stored again
        await _swapped_out(mgr, [0, 1], K[:2])
        assert mgr.invalidate([K[0]]) == 1
        await _swapped_out(mgr, [2], [K[0]])
        # 2. stores that need every block evict each key once (reuse used to raise KeyError)
        await _swapped_out(mgr, [3, 4], K[2:4])
        await _swapped_out(mgr, [5, 6, 7], K[4:7])
        check_invariants(mgr)
        # 3. the manager stays usable: clear drops what is left, index and policy agree
        resident = len(mgr.snapshot().keys)
        assert resident > 0 and mgr.clear() == resident
        snap = mgr.snapshot()
        assert len(snap.keys) == snap.num_policy_keys == 0
        check_invariants(mgr)


@pytest.mark.parametrize("owned", [True, False])
@pytest.mark.asyncio
async def test_preempt_and_resume_of_a_request_without_blocks(owned: bool) -> None:
    kv = _kv(seed=41)
    async with _open(kv, _cfg(num_cpu_blocks=4, manage_gpu_blocks=owned)) as mgr:
        # 1. a request with an empty table (allocate(r, 0) / append_blocks(r, []))
        if owned:
            assert mgr.allocate("r", 0) == []
        else:
            mgr.append_blocks("r", [])
        # 2. its preempt has nothing to copy: it resolves at once and the request is swapped
        #    out, not moving (it used to stay moving for ever and free() raised)
        result = await asyncio.wait_for(mgr.preempt("r"), 5.0)
        assert result.num_blocks == 0 and not mgr.is_moving("r")
        check_invariants(mgr)
        # 3. resume the same way, then free
        await asyncio.wait_for(mgr.resume("r", None if owned else []), 5.0)
        assert not mgr.is_moving("r") and mgr.block_table("r") == []
        await asyncio.wait_for(mgr.preempt("r"), 5.0)
        mgr.free("r")
        check_invariants(mgr)
        assert mgr.snapshot().tables == {}
