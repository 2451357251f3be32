"""Recorded per-call stores (issue 27, ``kvmgr.scheduler.deferred``): a plain ``swap_out`` is
recorded at the call and prepared with the others at the next settle; every call observes what
it would have observed had each store been prepared at its call, but for the victims of ARC and
S3-FIFO (evicted once for the step's shortfall: the xfail below).

Host engine, CPU tensors of seeded random bytes; loads read back what the stores wrote.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib

import pytest
import torch

from kvmgr import ClosedError, ManagerConfig, OffloadManager, PoolExhaustedError, SwapResult
from kvmgr.manager import CpuState
from kvmgr.testing import NullEngine, check_invariants

NUM_GPU = 16
K = [hashlib.blake2b(f"d{i}".encode(), digest_size=16).digest() for i in range(64)]


def _kv(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (NUM_GPU, 256), dtype=torch.uint8, generator=gen)]


def _cfg(num_cpu_blocks: int = 8, **kw: object) -> ManagerConfig:
    return ManagerConfig(num_cpu_blocks=num_cpu_blocks, engine="host", **kw)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_recorded_stores_are_seen_pending_by_the_next_call_and_land_with_their_bytes() -> (
    None
):
    kv = _kv(1)
    async with OffloadManager(kv, _cfg()) as mgr:
        gpu = mgr.allocate("r", NUM_GPU)
        a = mgr.swap_out(gpu[0:2], K[0:2])  # recorded
        b = mgr.swap_out(gpu[2:3], K[2:3])
        assert len(mgr._deferred) == 2  # nothing prepared yet
        snap = mgr.snapshot()  # an observation settles first
        assert len(mgr._deferred) == 0
        assert {k: snap.keys[k].state for k in K[:3]} == dict.fromkeys(K[:3], CpuState.PENDING)
        assert [s.keys for s in snap.swaps] == [tuple(K[0:2]), tuple(K[2:3])]
        assert mgr.statistics().queued_swaps == 2
        report = await mgr.step()
        assert report.d2h.swaps == 2 and report.d2h.batches == 1
        ra, rb = await a, await b
        assert isinstance(ra, SwapResult) and (ra.num_blocks, rb.num_blocks) == (2, 1)
        assert ra.gpu_block_ids == (gpu[0], gpu[1]) and rb.gpu_block_ids == (gpu[2],)
        pool = mgr.cpu_pool.tensors[0]
        for g, c in zip(ra.gpu_block_ids + rb.gpu_block_ids, ra.cpu_block_ids + rb.cpu_block_ids):
            assert torch.equal(pool[c], kv[0][g].view(torch.uint8))
        assert mgr.lookup(K[0:2]) == 2
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_key_recorded_twice_is_stored_once_and_one_block_twice_counts_twice() -> None:
    async with OffloadManager(_kv(2), _cfg()) as mgr:
        gpu = mgr.allocate("r", 4)
        first = mgr.swap_out([gpu[0]], [K[0]])
        again = mgr.swap_out([gpu[1]], [K[0]])  # the key is recorded: the general path skips it
        same_block = mgr.swap_out([gpu[0]], [K[1]])  # another key from the same GPU block
        snap = mgr.snapshot()
        assert mgr._books.gpu.busy[gpu[0]] == 2
        assert [s.keys for s in snap.swaps if s.keys] == [(K[0],), (K[1],)]
        await mgr.step()
        assert (await first).num_blocks == 1 and (await same_block).num_blocks == 1
        assert (await again).num_skipped == 1
        assert mgr._books.gpu.busy[gpu[0]] == 0
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_no_room_raises_at_the_call_with_nothing_changed() -> None:
    engine = NullEngine(hold=True)
    async with OffloadManager(_kv(3), _cfg(num_cpu_blocks=3), engine=engine) as mgr:
        gpu = mgr.allocate("r", 8)
        held = [mgr.swap_out([gpu[i]], [K[i]]) for i in range(3)]  # recorded: the tier's room
        before = mgr.snapshot()
        with pytest.raises(PoolExhaustedError):
            mgr.swap_out([gpu[3]], [K[3]])  # all 3 blocks reserved, none evictable
        assert mgr.snapshot() == before
        await mgr.step()
        engine.release()
        await asyncio.gather(*held)
        # the tier is full of READY keys now: a recorded store evicts the oldest at the settle
        late = mgr.swap_out([gpu[4]], [K[4]])
        assert mgr.peek([K[0]]) == 0 and mgr.peek(K[1:3]) == 2  # the oldest call's key went
        await mgr.step()
        engine.release()
        assert (await late).num_blocks == 1
        assert mgr.statistics().evictions == 1 and mgr.peek([K[4]]) == 1
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_cancelled_recorded_store_still_lands_and_close_fails_the_recorded_ones() -> None:
    mgr = OffloadManager(_kv(4), _cfg())
    async with mgr:
        gpu = mgr.allocate("r", 4)
        cancelled = mgr.swap_out([gpu[0]], [K[0]])
        kept = mgr.swap_out([gpu[1]], [K[1]])
        cancelled.cancel()
        await mgr.step()
        assert (await kept).num_blocks == 1
        assert mgr.peek([K[0]]) == 1  # the copy ran: only the await was cancelled
        orphan = mgr.swap_out([gpu[2]], [K[2]])
    with pytest.raises(ClosedError):
        await orphan  # recorded, then failed at close like any queued swap
    assert mgr.closed


@pytest.mark.asyncio
async def test_a_queued_per_call_store_keeps_about_one_gc_tracked_object() -> None:
    async with OffloadManager(_kv(5), _cfg(num_cpu_blocks=64)) as mgr:
        gpu = mgr.allocate("r", NUM_GPU)
        gc.collect()
        before = len(gc.get_objects())
        futures = [mgr.swap_out([gpu[i]], [K[i]]) for i in range(NUM_GPU)]
        gc.collect()
        per_call = (len(gc.get_objects()) - before) / NUM_GPU
        assert per_call < 2  # its future (the ids and keys sit in shared flat buffers)
        await mgr.step()
        await asyncio.gather(*futures)


@pytest.mark.asyncio
async def test_tick_flush_submits_recorded_stores_at_the_end_of_the_tick() -> None:
    async with OffloadManager(_kv(6), _cfg(flush="tick")) as mgr:
        gpu = mgr.allocate("r", 2)
        future = mgr.swap_out([gpu[0]], [K[0]])
        result = await asyncio.wait_for(future, 5)
        assert result.num_blocks == 1 and mgr.peek([K[0]]) == 1


# Found by a new user (round 4) with a differential run of plain swap_out calls (recorded)
# against the same calls with ``parents=[None]`` (prepared at the call): the recorded path
# evicts at the settle, before inserting the step's keys, and then the whole shortfall in one
# policy call, while the general path evicts at each call, after the earlier calls' inserts.
# LRU ends the same; ARC (its T1/T2 balance) and S3-FIFO (its small/main queues) pick other
# victims, so "every call observes what it would have observed had each store been prepared
# at its call" does not hold for them. Shortest programs found (steps of single-block stores
# and lookups, a 3-block tier):
_DIVERGING = {
    "s3fifo": [["s5"], ["s4", "s2", "s0"], ["s1"]],
    "arc": [["s2", "s0"], ["s4", "s0", "s1"], ["s3", "s2"], ["l3", "s4"]],
}


async def _survivors(policy: str, program: list[list[str]], *, recorded: bool) -> list[bytes]:
    extra = {} if recorded else {"parents": [None]}  # parents: the general path
    async with OffloadManager(_kv(), _cfg(3, policy=policy)) as mgr:
        gpu, futures = mgr.allocate("r", NUM_GPU), []
        for step in program:
            for op in step:
                key = K[int(op[1:])]
                if op[0] == "l":
                    mgr.lookup([key])
                else:
                    futures.append(mgr.swap_out([gpu[len(futures)]], [key], **extra))
            await mgr.step()
            await asyncio.gather(*futures)
            check_invariants(mgr)
        return [key for key in K[:8] if mgr.peek([key])]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", sorted(_DIVERGING))
@pytest.mark.xfail(
    strict=True,
    reason="recorded per-call stores evict at the settle, not at each call: ARC and S3-FIFO "
    "choose other victims than the same stores prepared at their calls",
)
async def test_recorded_stores_evict_what_stores_prepared_at_their_calls_evict(
    policy: str,
) -> None:
    program = _DIVERGING[policy]
    recorded = await _survivors(policy, program, recorded=True)
    assert recorded == await _survivors(policy, program, recorded=False)


@pytest.mark.asyncio
async def test_recorded_lru_stores_evict_what_stores_prepared_at_their_calls_evict() -> None:
    for program in _DIVERGING.values():
        recorded = await _survivors("lru", program, recorded=True)
        assert recorded == await _survivors("lru", program, recorded=False)


@pytest.mark.asyncio
async def test_recorded_lru_stores_decide_as_stores_prepared_at_their_calls_on_random_programs() -> (
    None
):
    # the new user's differential run, kept for LRU (30 seeds; ARC and S3-FIFO: the xfail above)
    import random

    for seed in range(30):
        rng = random.Random(seed)
        program, stores = [], 0
        while stores < NUM_GPU - 3:
            step = [f"{rng.choice('ssl')}{rng.randrange(8)}" for _ in range(rng.randint(1, 3))]
            stores += sum(op[0] == "s" for op in step)
            program.append(step)
        recorded = await _survivors("lru", program, recorded=True)
        assert recorded == await _survivors("lru", program, recorded=False), (seed, program)
