"""GroupedManager: real bytes per group through the host engine; restorable lookups, window
loads, orphan eviction, typed errors, vLLM events."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_groups_spec import hashes

from kvmgr import ManagerConfig
from kvmgr.errors import PoolExhaustedError, UnknownKeyError
from kvmgr.groups import (
    GroupedLayout,
    GroupedManager,
    GroupKeyError,
    GroupSpec,
    GroupSpecError,
    offload_key,
    split_offload_key,
)

BS = 16
FULL = GroupSpec(name="full", kind="full", block_size=BS, page_bytes=(BS * 8, BS * 8))
SWA = GroupSpec(name="swa", kind="sliding_window", block_size=BS, page_bytes=(BS * 4,), window=33)
MAMBA = GroupSpec(name="mamba", kind="recurrent", block_size=2 * BS, page_bytes=(96,))
LAYOUT = GroupedLayout([FULL, SWA, MAMBA], hash_block_size=BS)
NUM_GPU = 32


async def store_now(mgr: Any, hashes: list[bytes], block_ids: dict[str, list[Any]]) -> Any:
    """``mgr.store(hashes, block_ids)``, stepped and awaited; its result."""
    store = mgr.store(hashes, block_ids)
    await mgr.step()
    return await store


def caches(gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """Random bytes (never zeros) in every page of every group."""
    return {
        g.name: [
            torch.randint(0, 256, (NUM_GPU, p), dtype=torch.uint8, generator=gen)
            for p in g.page_bytes
        ]
        for g in LAYOUT.groups
    }


def make(kv: dict[str, list[torch.Tensor]], cpu: dict[str, int] | None = None) -> GroupedManager:
    return GroupedManager.create(LAYOUT, kv, cpu or {"full": 64, "swa": 64, "mamba": 32})


def tables(n_hash: int, base: int = 0) -> dict[str, list[int | None]]:
    return {
        g.name: [base + j for j in range(LAYOUT.num_blocks(i, n_hash))]
        for i, g in enumerate(LAYOUT.groups)
    }


@pytest.mark.asyncio
async def test_round_trip_loads_each_groups_live_blocks_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = caches(gen)
    hs = hashes(8)
    async with make(kv) as mgr:
        src = tables(8)  # blocks 0..7 (mamba 0..3)
        result = await store_now(mgr, hs, src)
        assert (
            result.num_bytes == 8 * FULL.block_bytes + 8 * SWA.block_bytes + 4 * MAMBA.block_bytes
        )
        plan = mgr.lookup(hs)
        assert plan.num_tokens == 128
        assert plan.blocks == (range(8), range(6, 8), range(3, 4))  # the window, one state
        # fresh destinations, poisoned with other random bytes
        dst = {name: [16 + j for j in range(8)] for name in ("full", "swa", "mamba")}
        before = {n: [t.clone() for t in ts] for n, ts in kv.items()}
        loaded = mgr.load(plan, dst)
        await mgr.step()
        await loaded
        for i, g in enumerate(LAYOUT.groups):
            for t, old in zip(kv[g.name], before[g.name], strict=True):
                for j in range(LAYOUT.num_blocks(i, 8)):
                    want = old[src[g.name][j]] if j in plan.blocks[i] else old[dst[g.name][j]]
                    assert torch.equal(t[dst[g.name][j]], want), (g.name, j)  # loaded or untouched
        assert mgr.index.num_held() == 20


@pytest.mark.asyncio
async def test_window_blocks_freed_on_the_gpu_are_not_stored_and_still_restore() -> None:
    kv = caches(torch.Generator().manual_seed(2))
    hs = hashes(8)
    async with make(kv) as mgr:
        src = tables(8)
        src["swa"] = [None] * 6 + [6, 7]  # the GPU dropped the blocks left of the window
        await store_now(mgr, hs, src)
        assert mgr.lookup(hs).num_tokens == 128
        assert mgr.lookup(hs[:6]).num_tokens == 0  # boundary 96 needs window blocks 4, 5


@pytest.mark.asyncio
async def test_full_eviction_drops_the_other_groups_orphans() -> None:
    kv = caches(torch.Generator().manual_seed(3))
    a, b = hashes(8, b"a"), hashes(8, b"b")
    # the full group holds 8 blocks: storing B evicts A's full blocks (LRU, leaves first)
    async with make(kv, {"full": 8, "swa": 64, "mamba": 32}) as mgr:
        await store_now(mgr, a, tables(8))
        await store_now(mgr, b, tables(8, base=8))
        assert mgr.lookup(b).num_tokens == 128
        assert mgr.lookup(a).num_tokens == 0
        swa_mgr, mamba_mgr = mgr.managers[1], mgr.managers[2]
        # nothing of A is held in the other groups: their CPU memory is free again
        for g, m in ((1, swa_mgr), (2, mamba_mgr)):
            keys = LAYOUT.keys(g, a, range(LAYOUT.num_blocks(g, 8)))
            assert all(m.peek([k]) == 0 for k in keys)
        assert swa_mgr.statistics().cpu_blocks_used == 8
        assert mamba_mgr.statistics().cpu_blocks_used == 4
        assert mgr.num_orphans_dropped == 12
        removed = {k for e in mgr.take_events() if e.kind == "removed" for k in e.keys}
        assert {split_offload_key(k)[0] for k in removed} == set(a)


@pytest.mark.asyncio
async def test_bad_input_raises_before_anything_changes() -> None:
    hs = hashes(4)
    async with make(caches(torch.Generator().manual_seed(4))) as mgr:
        bad = tables(4)
        bad["mamba"] = ["x", 1]  # type: ignore[list-item]
        with pytest.raises(GroupKeyError):
            mgr.store(hs, bad)
        with pytest.raises(GroupKeyError, match="unknown group"):
            mgr.store(hs, {"nope": [0]})
        with pytest.raises(GroupKeyError):
            mgr.store([b"a", 3], tables(2))  # type: ignore[list-item]
        assert mgr.index.num_held() == 0
        assert all(m.statistics().cpu_blocks_used == 0 for m in mgr.managers)
        # a hash list that contradicts a stored chain
        await store_now(mgr, hs, tables(4))
        with pytest.raises(GroupKeyError, match="chain"):
            mgr.store([hs[1], hs[0]], tables(2))
        plan = mgr.lookup(hs)
        with pytest.raises(GroupKeyError):
            mgr.load(plan, {"full": [0, 1]})  # too short, and groups missing


@pytest.mark.asyncio
async def test_load_of_a_plan_whose_block_left_raises_unknown_key() -> None:
    kv = caches(torch.Generator().manual_seed(5))
    hs = hashes(4)
    async with make(kv) as mgr:
        await store_now(mgr, hs, tables(4))
        plan = mgr.lookup(hs)
        mgr.managers[1].invalidate([offload_key(hs[3], 1)])  # behind the grouped manager's back
        with pytest.raises(UnknownKeyError):
            mgr.load(plan, tables(4, base=8))
        assert mgr.lookup(hs).num_tokens == 32  # the index saw the removal


@pytest.mark.asyncio
async def test_pool_exhausted_in_one_group_leaves_no_orphans() -> None:
    kv = caches(torch.Generator().manual_seed(6))
    hs = hashes(8)
    async with make(kv, {"full": 64, "swa": 64, "mamba": 2}) as mgr:
        with pytest.raises(PoolExhaustedError, match="mamba"):
            mgr.store(hs, tables(8))  # mamba needs 4 blocks, has 2
        # all or nothing: no group's store was queued
        assert all(m.statistics().queued_swaps == 0 for m in mgr.managers)
        assert mgr.index.num_held() == 0
        await mgr.step()
        assert all(m.statistics().cpu_blocks_used == 0 for m in mgr.managers)
        await store_now(mgr, hs[:4], tables(4))  # 2 states fit
        assert mgr.lookup(hs).num_tokens == 64


def test_layout_and_managers_must_agree() -> None:
    kv = caches(torch.Generator().manual_seed(7))
    kv["swa"] = [torch.zeros(NUM_GPU, 8, dtype=torch.uint8)]
    with pytest.raises(GroupSpecError, match="page bytes"):
        make(kv)
    with pytest.raises(GroupSpecError, match="num_cpu_blocks"):
        GroupedManager.create(LAYOUT, caches(torch.Generator()), {"full": 4})
    cfg = ManagerConfig(num_cpu_blocks=1, engine="host", manage_gpu_blocks=False, max_events=0)
    with pytest.raises(GroupSpecError, match="max_events"):
        GroupedManager.create(
            LAYOUT, caches(torch.Generator()), {"full": 4, "swa": 4, "mamba": 4}, cfg
        )


@pytest.mark.asyncio
async def test_events_decode_as_vllms_with_hash_and_group_apart() -> None:
    msgspec = pytest.importorskip("msgspec")
    from vllm_events_support import vllm_kv_events

    from kvmgr.events import encode_batch
    from kvmgr.events.vllm_format import KVEventBatch
    from kvmgr.groups.events import to_vllm_events

    ve = vllm_kv_events()
    kv = caches(torch.Generator().manual_seed(8))
    hs = hashes(4)
    async with make(kv) as mgr:
        await store_now(mgr, hs, tables(4))
        events = mgr.take_events()
    structs = to_vllm_events(LAYOUT, events, hash_format="bytes")
    by_group = {s.group_idx: s for s in structs if type(s).__name__ == "BlockStored"}
    assert sorted(by_group) == [0, 1, 2]
    assert by_group[0].block_hashes == hs and by_group[0].parent_block_hash is None
    assert by_group[2].block_hashes == [hs[1], hs[3]]  # one state per 32-token boundary
    assert by_group[2].block_size == 32 and by_group[2].kv_cache_spec_kind == "mamba"
    assert by_group[1].kv_cache_spec_sliding_window == 33
    decoded = msgspec.msgpack.Decoder(type=ve.KVEventBatch).decode(
        encode_batch(KVEventBatch(1.0, structs, None))
    )
    got = {e.group_idx: e for e in decoded.events if isinstance(e, ve.BlockStored)}
    assert got[2].block_hashes == [hs[1], hs[3]] and got[1].kv_cache_spec_sliding_window == 33


@pytest.mark.asyncio
async def test_index_resyncs_when_a_groups_event_stream_dropped_events() -> None:
    kv = caches(torch.Generator().manual_seed(9))
    cfg = ManagerConfig(num_cpu_blocks=1, engine="host", manage_gpu_blocks=False, max_events=1)
    hs = hashes(8)
    async with GroupedManager.create(LAYOUT, kv, {"full": 64, "swa": 64, "mamba": 32}, cfg) as mgr:
        await store_now(mgr, hs, tables(8))
        mgr.sync()  # the stored events (they may land after the step)
        # two removals behind the grouped manager's back: the one-event stream keeps one
        swa = mgr.managers[1]
        swa.invalidate([offload_key(hs[2], 1)])
        swa.invalidate([offload_key(hs[7], 1)])
        assert swa.statistics().events_dropped == 1
        await mgr.step()  # sees the drop and rebuilds the group's index from its tier
        in_tier = {k for m in mgr.managers for k in m.snapshot().keys}
        assert set(mgr.index.held_keys()) == in_tier
        # boundary 128 needs window block 7 (gone), 96 needs block 5 and 4; 64 needs 2 (gone)
        assert mgr.lookup(hs).num_tokens == 96


@pytest.mark.asyncio
async def test_a_failed_store_in_one_group_drops_the_others_orphans() -> None:
    from kvmgr import OffloadManager, TransferError
    from kvmgr.testing import FaultyEngine
    from kvmgr.transfer.host import HostEngine

    kv = caches(torch.Generator().manual_seed(10))
    cfg = ManagerConfig(num_cpu_blocks=64, engine="host", manage_gpu_blocks=False)
    managers = [
        OffloadManager(kv["full"], cfg),
        OffloadManager(kv["swa"], cfg, engine=FaultyEngine(HostEngine(), fail_batches={0})),
        OffloadManager(kv["mamba"], cfg),
    ]
    hs = hashes(4)
    async with GroupedManager(LAYOUT, managers) as mgr:
        stored = mgr.store(hs, tables(4))
        await mgr.step()
        with pytest.raises(TransferError):
            await stored  # raised once every group's copy ended: full and mamba landed
        mgr.sync()
        assert mgr.lookup(hs).num_tokens == 0
        # the full and mamba blocks restore nothing without the window: dropped, memory free
        assert mgr.index.num_held() == 0
        assert all(m.statistics().cpu_blocks_used == 0 for m in mgr.managers)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["lookup", "peek"])
async def test_a_lookup_whose_hashes_contradict_a_stored_chain_raises(how: str) -> None:
    # A hasher that is not chained (equal blocks of tokens at two positions: equal hashes)
    # gives [h0, h0, ...]; the stored chain says h0 is at position 0. The lookup used to plan
    # h0's blocks (position 0's KV) for logical block 1 too: wrong KV once loaded.
    hs = hashes(4)
    async with make(caches(torch.Generator().manual_seed(12))) as mgr:
        await store_now(mgr, hs, tables(4))
        for bad in ([hs[0], hs[0]], [hs[0], hs[1], hs[1], hs[1]], [hs[1], hs[2]]):
            with pytest.raises(GroupKeyError, match="chain"):
                getattr(mgr, how)(bad)
        assert getattr(mgr, how)(hs).num_tokens == 4 * BS  # the stored chain still restores
