"""Round 4, session 11 (newuser13): what a new user who must never serve wrong KV hit.

1. With caller-owned GPU blocks (``manage_gpu_blocks=False``) the docs said a block may be
   reused once "the swap's future has resolved". A future cancelled by a bounded await
   (``asyncio.wait_for``, ``asyncio.timeout``, a cancelled task) is done at once, but its copy
   still runs (at the next ``step()`` if it was queued): a loop that took "done" for "resolved" and rewrote the
   block stored the new bytes under the old key (wrong KV served by every later load). The
   docs now say so and name the ways to know: ``mgr.wait`` (never cancels the future) and
   ``snapshot().gpu_busy`` (the block stays busy until the copy ended). The tests pin both.
2. ``swap_out`` refuses a key repeated in one call with ``InvalidKeyError`` (nothing changes),
   where ``store_many`` stores it once: the docstring said only "bad keys".
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import InvalidKeyError, TransferTimeoutError

KEY = b"A" * 8


async def _cancelled_store(mgr: OffloadManager, kv: torch.Tensor) -> asyncio.Future:
    mgr.append_blocks("a", [0])
    kv[0] = 1.0  # block 0 holds key A's KV
    future = mgr.swap_out([0], [KEY])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(future, 0.01)  # a bounded await cancels the future ...
    assert future.cancelled()
    return future


async def _load_back(mgr: OffloadManager, kv: torch.Tensor) -> float:
    """Key A loaded into block 1: what it serves."""
    mgr.append_blocks("b", [1])
    load = mgr.swap_in([KEY], [1])
    await mgr.step()
    await load
    return float(kv[1, 0, 0])


@pytest.mark.asyncio
@pytest.mark.parametrize("reuse", ["after-gpu-busy", "once-done"])
async def test_a_cancelled_store_still_copies_and_gpu_busy_says_until_when(reuse: str) -> None:
    """``once-done`` is what the docs now warn against: "done" is not "copied"."""
    kv = torch.zeros(4, 2, 2)
    config = ManagerConfig(num_cpu_blocks=4, manage_gpu_blocks=False)
    async with OffloadManager([kv], config) as mgr:
        await _cancelled_store(mgr, kv)
        assert mgr.snapshot().gpu_busy == {0: 1}  # ... but the copy is still to come
        if reuse == "once-done":
            kv[0] = 2.0  # reused while the store is still queued
        await mgr.step()
        for _ in range(200):  # the host engine's copy thread
            if not mgr.snapshot().gpu_busy:
                break
            await asyncio.sleep(0.005)
        assert mgr.snapshot().gpu_busy == {}  # now block 0 may be reused
        kv[0] = 3.0
        want = 2.0 if reuse == "once-done" else 1.0  # once-done: key A serves the other bytes
        assert await _load_back(mgr, kv) == want


@pytest.mark.asyncio
async def test_mgr_wait_bounds_the_await_without_cancelling() -> None:
    kv = torch.zeros(4, 2, 2)
    config = ManagerConfig(num_cpu_blocks=4, manage_gpu_blocks=False)
    async with OffloadManager([kv], config) as mgr:
        mgr.append_blocks("a", [0])
        kv[0] = 1.0
        future = mgr.swap_out([0], [KEY])
        with pytest.raises(TransferTimeoutError):
            await mgr.wait(future, 0.01)
        assert not future.done()  # still the copy's own future: resolved once it ended
        await mgr.step()
        result = await mgr.wait(future, 10.0)
        assert result.num_blocks == 1 and mgr.snapshot().gpu_busy == {}


@pytest.mark.asyncio
async def test_swap_out_refuses_a_repeated_key_and_store_many_stores_it_once() -> None:
    kv = torch.zeros(8, 2, 2)
    async with OffloadManager([kv], ManagerConfig(num_cpu_blocks=8)) as mgr:
        blocks = mgr.allocate("r", 2)
        before = mgr.snapshot()
        with pytest.raises(InvalidKeyError, match="distinct"):
            mgr.swap_out(blocks, [KEY, KEY])
        assert mgr.snapshot() == before
        store = mgr.store_many(blocks, [KEY, KEY])
        await mgr.step()
        result = await store
        assert result.stored.tolist() == [True, False] and result.present.tolist() == [False, True]
