"""Backpressure ``"wait"``: a store waiting for room holds its GPU blocks like a queued store.

Every scenario fills the 2-block CPU tier with READY keys whose loads are held in flight (so
nothing is evictable), makes a store of request ``A``'s block wait, and then does what a serving
loop may do meanwhile: free ``A``, allocate for ``B``, step, cancel, close. Bytes are compared
with what each block held when it was stored (issue 20: the waiting store used to protect none
of its blocks and stored ``B``'s KV under ``A``'s key).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from kvmgr import ClosedError, ManagerConfig, OffloadManager, PoolExhaustedError
from kvmgr.manager import GpuState
from kvmgr.testing import FaultyEngine, VirtualClock, check_invariants
from kvmgr.transfer import HostEngine

KEYS = [f"bp-{i}".encode() for i in range(8)]
NUM_GPU = 5  # 2 to fill the tier, 2 load targets, 1 for request A: the pool is then empty


def _kv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_GPU, 2, 7, generator=gen), torch.randn(NUM_GPU, 9, generator=gen)]


def _page(kv: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block].clone() for t in kv]


def _write(kv: list[torch.Tensor], block: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv:
        t[block] = torch.randn(t[block].shape, generator=gen)


def _stored(mgr: OffloadManager, key: bytes) -> list[bytes]:
    block = mgr.snapshot().keys[key].cpu_block_id
    return [bytes(pages[block].numpy()) for pages in mgr.cpu_pool.tensors]


def _as_bytes(page: list[torch.Tensor]) -> list[bytes]:
    return [bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in page]


@contextlib.asynccontextmanager
async def _pinned_full_tier(
    seed: int, store_wait_s: float = 60.0
) -> AsyncIterator[tuple[OffloadManager, FaultyEngine, list[torch.Tensor], Any]]:
    """An open manager whose 2-block tier holds K0, K1 READY with held loads (not evictable)."""
    kv = _kv(seed)
    engine = FaultyEngine(HostEngine())
    config = ManagerConfig(num_cpu_blocks=2, backpressure="wait", store_wait_s=store_wait_s)
    mgr = OffloadManager(kv, config, engine=engine)
    await mgr.__aenter__()
    try:
        fill = mgr.allocate("fill", 2)
        store = mgr.swap_out(fill, KEYS[:2])
        await mgr.step()
        await store
        engine.hold()
        load = mgr.swap_in(KEYS[:2], mgr.allocate("loads", 2))
        await mgr.step()  # the loads are in flight, held: K0 and K1 are pinned
        yield mgr, engine, kv, load
    finally:
        engine.release()
        await mgr.aclose(timeout_s=2.0)


def _store(mgr: OffloadManager, batched: bool, block: int, key: bytes) -> asyncio.Future[Any]:
    if batched:
        return mgr.store_many([block], [key])
    return mgr.swap_out([block], [key])


@pytest.mark.parametrize("batched", [False, True], ids=["swap_out", "store_many"])
@pytest.mark.asyncio
async def test_freed_block_of_a_waiting_store_is_not_handed_to_another_request(
    batched: bool,
) -> None:
    async with _pinned_full_tier(seed=1) as (mgr, engine, kv, load):
        # 1. request A's KV is in its block; its store waits for room
        (a,) = mgr.allocate("A", 1)
        _write(kv, a, seed=100)
        a_bytes = _as_bytes(_page(kv, a))
        waiting = _store(mgr, batched, a, KEYS[5])
        await asyncio.sleep(0)
        assert not waiting.done() and mgr.statistics().stores_waiting == 1
        check_invariants(mgr)
        # 2. A finishes and is freed: the block is DRAINING (the waiting store still reads it)
        mgr.free("A")
        assert mgr.snapshot().gpu_states[a] is GpuState.DRAINING
        check_invariants(mgr)
        # 3. B allocates: it must not get A's block; B writes its KV into what it got
        try:
            got = mgr.allocate("B", 1)
        except PoolExhaustedError:
            got = []
        assert a not in got
        for block in got:
            _write(kv, block, seed=200)
        # 4. the loads end: room; the store is queued at once, the next step submits it
        engine.release()
        await load
        await mgr.step()
        await asyncio.wait_for(waiting, 5.0)
        # 5. the key holds A's KV, and A's block went back to the pool once it was read
        assert _stored(mgr, KEYS[5]) == a_bytes
        assert mgr.snapshot().gpu_states[a] is GpuState.FREE
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_waiting_store_of_a_freed_request_still_stores_its_bytes() -> None:
    async with _pinned_full_tier(seed=2) as (mgr, engine, kv, load):
        (a,) = mgr.allocate("A", 1)
        a_bytes = _as_bytes(_page(kv, a))
        waiting = mgr.swap_out([a], [KEYS[6]])
        await asyncio.sleep(0)
        mgr.free("A")  # documented as safe while keyed swaps of the request's blocks run
        engine.release()
        await load
        await mgr.step()
        result = await asyncio.wait_for(waiting, 5.0)  # used to fail: InvalidBlockError
        assert result.gpu_block_ids == (a,) and _stored(mgr, KEYS[6]) == a_bytes
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_store_woken_by_a_completion_is_submitted_by_the_next_step() -> None:
    async with _pinned_full_tier(seed=3) as (mgr, engine, _kv_tensors, load):
        (a,) = mgr.allocate("A", 1)
        waiting = mgr.swap_out([a], [KEYS[5]])
        await asyncio.sleep(0)
        # the loads end and, right after their future resolved, the loop steps once: the
        # woken store must be in that step (it used to be queued after it and hang)
        engine.release()
        await load
        assert mgr.statistics().queued_swaps == 1 and mgr.statistics().stores_waiting == 0
        await mgr.step()
        await asyncio.wait_for(waiting, 5.0)
        check_invariants(mgr)


@pytest.mark.parametrize("how", ["cancel", "timeout", "close"])
@pytest.mark.asyncio
async def test_a_waiting_store_that_gives_up_releases_its_blocks(how: str) -> None:
    async with _pinned_full_tier(seed=4, store_wait_s=5.0) as (mgr, engine, _kv_tensors, _load):
        with VirtualClock().install(asyncio.get_running_loop()) as clock:
            (a,) = mgr.allocate("A", 1)
            waiting = mgr.swap_out([a], [KEYS[5]])
            await asyncio.sleep(0)
            mgr.free("A")
            free_before = mgr.statistics().gpu_blocks_free
            if how == "cancel":
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
            elif how == "timeout":
                clock.advance(5.0)
                with pytest.raises(PoolExhaustedError) as caught:
                    await waiting
                assert caught.value.reason == "timeout"
                assert "store_wait_s" in str(caught.value)
            else:
                engine.release()
                await mgr.aclose(timeout_s=2.0)
                with pytest.raises(ClosedError):
                    await waiting
            await asyncio.sleep(0)
            # the block is back in the pool, and nothing retries the store later
            assert mgr.snapshot().gpu_states[a] is GpuState.FREE
            assert mgr.statistics().gpu_blocks_free == free_before + 1
            assert mgr.statistics().stores_waiting == 0
            assert KEYS[5] not in mgr.snapshot().keys
            check_invariants(mgr)


@pytest.mark.parametrize("second", [1, 2], ids=["one-block", "two-blocks"])
@pytest.mark.asyncio
async def test_a_store_behind_a_recorded_call_of_its_step_waits_instead_of_raising(
    second: int,
) -> None:
    # A plain swap_out is recorded (its room reserved) until the step settles it. A second
    # plain swap_out of the same step that finds no room must wait like any store under
    # "wait": it fits the tier on its own (it used to raise PoolExhaustedError at once, its
    # `needed` counting the first call's reserved blocks too: 3 or 4 of a 2-block tier).
    kv = _kv(seed=5)
    config = ManagerConfig(num_cpu_blocks=2, backpressure="wait", store_wait_s=60.0)
    async with OffloadManager(kv, config, engine=FaultyEngine(HostEngine())) as mgr:
        first_blocks, blocks = mgr.allocate("A", 2), mgr.allocate("B", second)
        first = mgr.swap_out(first_blocks, KEYS[:2])
        b_bytes = [_as_bytes(_page(kv, b)) for b in blocks]
        waiting = mgr.swap_out(blocks, KEYS[2 : 2 + second])
        await asyncio.sleep(0)
        assert not waiting.done() and mgr.statistics().stores_waiting == 1
        check_invariants(mgr)
        await mgr.step()
        await first  # READY now, so evictable: the waiting store is queued
        await mgr.step()
        result = await asyncio.wait_for(waiting, 5.0)
        assert result.num_blocks == second
        assert [_stored(mgr, k) for k in KEYS[2 : 2 + second]] == b_bytes
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_pool_exhausted_behind_a_recorded_call_names_the_calls_own_need() -> None:
    kv = _kv(seed=6)
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=2)) as mgr:
        a, b = mgr.allocate("A", 2), mgr.allocate("B", 1)
        first = mgr.swap_out(a, KEYS[:2])
        with pytest.raises(PoolExhaustedError) as caught:
            mgr.swap_out(b, KEYS[2:3])
        assert caught.value.needed == 1  # "blocks the operation asked for"
        assert "need 1 blocks" in str(caught.value)
        await mgr.step()
        await first
        check_invariants(mgr)
