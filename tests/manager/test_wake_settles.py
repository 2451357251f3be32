"""A store waiting for room and a recorded per-call store of the same key (stress finding
"key ... is already tracked by the arc policy", seed 3001).

A copy's completion wakes the waiting stores (``backpressure``) without any call of the manager
settling the recorded per-call stores (``kvmgr.scheduler.deferred``). The retry used to index a
key that a recorded call had already claimed, and the settle then indexed it a second time:
``policy.insert`` raised (arc, s3fifo), or, through LRU's unchecked ``insert_new``, the first
block leaked and the key chains broke. Now the wake settles first, so the retry sees the
recorded key PENDING (as it would have had the call been prepared at once) and skips it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, StoreResult, SwapResult
from kvmgr.manager import CpuState
from kvmgr.testing import FaultyEngine, check_invariants
from kvmgr.transfer import HostEngine

K = [f"wake-{i}".encode() for i in range(4)]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
async def test_a_wake_sees_the_keys_of_recorded_stores(policy: str) -> None:
    gen = torch.Generator().manual_seed(3)
    kv = [torch.randint(1, 255, (8, 64), dtype=torch.uint8, generator=gen)]
    engine = FaultyEngine(HostEngine())
    config = ManagerConfig(
        num_cpu_blocks=3, engine="host", policy=policy, backpressure="wait", store_wait_s=60.0
    )
    mgr = OffloadManager(kv, config, engine=engine)
    await mgr.__aenter__()
    try:
        fill = mgr.allocate("fill", 2)
        first = mgr.swap_out(fill, K[:2])
        await mgr.step()
        await first
        engine.hold()
        load = mgr.swap_in(K[:2], mgr.allocate("loads", 2))
        await mgr.step()  # K0, K1 pinned by held loads: one free block
        a = mgr.allocate("a", 2)
        waiting = mgr.store_many(a, K[2:4])  # needs two blocks: waits for room
        assert mgr.statistics().stores_waiting == 1
        b = mgr.allocate("b", 1)
        recorded = mgr.swap_out(b, K[3:4])  # one block: recorded, not prepared
        assert len(mgr._deferred) == 1
        engine.complete_next(1)  # the loads end: their completion wakes the waiting store
        await load
        for _ in range(3):
            await asyncio.sleep(0)
        snap = mgr.snapshot()
        check_invariants(mgr)
        assert {k: snap.keys[k].state for k in K[2:4]} == dict.fromkeys(K[2:4], CpuState.PENDING)
        engine.release()
        await mgr.step()
        stored, swapped = await waiting, await recorded
        assert isinstance(stored, StoreResult) and isinstance(swapped, SwapResult)
        assert stored.stored.tolist() == [True, False]  # K3 was the recorded call's
        assert swapped.num_blocks == 1
        pool = mgr.cpu_pool.tensors[0]
        snap = mgr.snapshot()
        for key, gpu in ((K[2], a[0]), (K[3], b[0])):
            assert snap.keys[key].state is CpuState.READY
            assert torch.equal(pool[snap.keys[key].cpu_block_id], kv[0][gpu])
        check_invariants(mgr)
    finally:
        engine.release()
        await mgr.aclose(timeout_s=2.0)


class _StoringHook:
    """A step hook that queues a store of one block in its first step, by each store path."""

    name = "storing-hook"

    def __init__(self, how: str) -> None:
        self.how, self.mgr, self.future, self.block = how, None, None, -1

    def __call__(self, ctx):  # type: ignore[no-untyped-def]
        from kvmgr import HookReport

        if self.future is None:
            assert self.mgr is not None
            (self.block,) = self.mgr.allocate("hook", 1)
            if self.how == "swap_out":  # list ids: recorded, prepared at the settle
                self.future = self.mgr.swap_out([self.block], [b"from-a-hook"])
            else:
                self.future = self.mgr.store_many([self.block], [b"from-a-hook"])
        return HookReport(name=self.name)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["swap_out", "store_many"])
async def test_a_store_queued_by_a_hook_is_submitted_by_that_step(how: str) -> None:
    # step() runs the hooks, then submits everything queued since the last step; a plain
    # swap_out recorded by a hook used to wait for the next step (the step settled the
    # recorded calls before running its hooks only)
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randint(1, 255, (8, 64), dtype=torch.uint8, generator=gen)]
    hook = _StoringHook(how)
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=4), hooks=[hook]) as mgr:
        hook.mgr = mgr
        report = await mgr.step()
        assert report.d2h.blocks == 1 and mgr.statistics().queued_swaps == 0
        result = await asyncio.wait_for(hook.future, 5.0)
        assert isinstance(result, (SwapResult, StoreResult)) and mgr.peek([b"from-a-hook"]) == 1
        page = mgr.cpu_pool.tensors[0][mgr.snapshot().keys[b"from-a-hook"].cpu_block_id]
        assert torch.equal(page, kv[0][hook.block])
        check_invariants(mgr)
