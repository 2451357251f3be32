"""The grouped room checks count only what a group's policy could really evict (session 15).

``GroupedManager.store`` and ``DeepSeekV4Offload.store`` counted every READY key without
readers as evictable (leftovers14). The policies evict leaves only, so a READY key above a key
that cannot go (PENDING, being read, or this store's own READY key) is no victim: the check
passed, the earlier groups' stores were queued, and a later group's ``swap_out`` refused (the
call's future then failed once those copies ended, ``kvmgr._futures.fail_after``). Now the
check is ``OffloadManager.check_store_room``: such a store is refused at the call, with
nothing queued in any group.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_groups_manager import caches, hashes, make, store_now, tables

from kvmgr.errors import PoolExhaustedError
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches


@pytest.mark.asyncio
async def test_grouped_store_above_its_own_ready_key_is_refused_at_the_call() -> None:
    """``mamba`` (2 CPU blocks) holds m0 -> m1 READY. A store naming m1 (present: protected)
    and a new m2 needs one block: m0 is READY without readers, but its child m1 is this
    store's, so no policy evicts it. The old count (2 READY - 1 protected) said 1."""
    kv = caches(torch.Generator().manual_seed(31))
    hs = hashes(6)
    async with make(kv, {"full": 64, "swa": 64, "mamba": 2}) as mgr:
        await store_now(mgr, hs[:4], tables(4))
        mamba = mgr.managers[-1]
        assert mamba.statistics().cpu_keys_ready == 2
        src = tables(6, base=8)
        src["mamba"] = [None, 9, 10]  # m1 again (present), m2 new
        with pytest.raises(PoolExhaustedError, match=r"group 'mamba'.*no group's store") as info:
            mgr.store(hs, src)
        assert (info.value.needed, info.value.available) == (1, 0)
        for m in mgr.managers:  # nothing queued, no block busy: the caller may reuse them
            assert m.statistics().queued_swaps == 0 and m.snapshot().gpu_busy == {}
        assert mgr.lookup(hs).num_tokens == 64  # the first store's prefix is intact


LAYOUT = DeepSeekV4Layout(compress_ratios=(0, 4, 128), head_dim=128)
N = 301


@pytest.mark.asyncio
async def test_dsv4_store_above_a_pending_key_is_refused_at_the_call() -> None:
    """``swa`` (4 CPU blocks) holds d0 -> d1 READY above d2 PENDING, one block free; a new
    restore point needs 3: d0 and d1 are READY without readers but no victims. The old count
    (1 free + 2 READY) said 3, ``compressed`` queued its store and ``swa`` refused."""
    need = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
    kv = allocate_caches(LAYOUT, {g: 4 * k for g, k in need.items()})
    cpu = dict(need, swa=need["swa"] + 1)
    offload = DeepSeekV4Offload.create(LAYOUT, kv, cpu, engine="host")
    tables_ = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in need.items()}
    async with offload:
        first = offload.store(N, tables_, [b"block-0"], b"request@301")
        await offload.step()
        await first
        swa = offload.managers["swa"]
        d = offload.keys(N, [b"block-0"], b"request@301")["swa"]
        swa.invalidate([d[2]])
        pending = swa.swap_out([5], [d[2]], [d[1]])  # PENDING below d0 -> d1
        with pytest.raises(PoolExhaustedError, match=r"group 'swa'.*no group's store") as info:
            offload.store(N, tables_, [b"block-1"], b"other@301")
        assert (info.value.needed, info.value.available) == (3, 1)
        for name, mgr in offload.managers.items():  # nothing queued but the PENDING one
            assert mgr.statistics().queued_swaps == (name == "swa"), name
        await asyncio.gather(pending, offload.step())
        again = offload.store(N, tables_, [b"block-1"], b"other@301")  # d2 READY: room now
        await offload.step()
        await again
        assert offload.is_restorable(N, [b"block-1"], b"other@301")
