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

import attrs
import pytest
import torch
from test_groups_manager import caches, hashes, make, store_now, tables

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import GeometryError, PoolExhaustedError
from kvmgr.groups import (
    GroupedLayout,
    GroupedManager,
    GroupKeyError,
    GroupSpec,
    GroupSpecError,
)
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


@pytest.mark.asyncio
async def test_dsv4_keys_the_threshold_turns_away_need_no_room() -> None:
    """``store_threshold=2``: a restore point seen once stores nothing, so it needs no block;
    the old check counted its keys as new and refused it on tiers one block short."""
    need = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
    kv = allocate_caches(LAYOUT, {g: 2 * k for g, k in need.items()})
    cpu = {g: max(1, k - 1) for g, k in need.items()}
    offload = DeepSeekV4Offload.create(LAYOUT, kv, cpu, engine="host", store_threshold=2)
    tables_ = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in need.items()}
    async with offload:
        first = offload.store(N, tables_, [b"block-0"], b"request@301")  # seen once: admitted
        await offload.step()  # by no group
        assert all(len(r.cpu_block_ids) == 0 for r in await first)
        with pytest.raises(PoolExhaustedError, match="no group's store"):
            offload.store(N, tables_, [b"block-0"], b"request@301")  # seen twice: too large
        assert all(m.statistics().queued_swaps == 0 for m in offload.managers.values())


@pytest.mark.asyncio
async def test_one_manager_for_two_dsv4_groups_is_refused() -> None:
    """Each group's room is checked on its own: one tier under two groups would pass both
    checks and refuse the second group's store after the first queued."""
    layout = DeepSeekV4Layout(compress_ratios=(4, 128, 128), head_dim=128)
    kv = allocate_caches(layout, {g.name: 8 for g in layout.groups})
    offload = DeepSeekV4Offload.create(layout, kv, {g.name: 8 for g in layout.groups})
    managers = dict(offload.managers, c128_state=offload.managers["c4_state"])  # equal pages
    with pytest.raises(GeometryError, match="one manager per group"):
        DeepSeekV4Offload(layout, managers)
    for mgr in offload.managers.values():
        mgr.close()


def test_one_manager_for_two_groups_is_refused() -> None:
    """Two groups of equal pages: before, one manager served both (and a store whose groups
    each fit alone refused the second group's part after the first queued)."""
    a = GroupSpec(name="a", kind="full", block_size=16, page_bytes=(128,))
    layout = GroupedLayout([a, attrs.evolve(a, name="b")], hash_block_size=16)
    cfg = ManagerConfig(num_cpu_blocks=4, engine="host", manage_gpu_blocks=False)
    mgr = OffloadManager([torch.zeros((8, 128), dtype=torch.uint8)], cfg)
    try:
        with pytest.raises(GroupSpecError, match="one manager per group"):
            GroupedManager(layout, [mgr, mgr])
    finally:
        mgr.close()


@pytest.mark.asyncio
async def test_a_repeated_block_hash_is_a_group_key_error_before_any_queue() -> None:
    kv = caches(torch.Generator().manual_seed(33))
    hs = hashes(4)
    async with make(kv) as mgr:
        with pytest.raises(GroupKeyError, match=r"group 'full'.*no group's store"):
            mgr.store([hs[0], hs[0], *hs[2:]], tables(4))
        assert all(m.statistics().queued_swaps == 0 for m in mgr.managers)
