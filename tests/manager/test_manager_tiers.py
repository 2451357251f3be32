"""The manager over lower tiers: write-back on eviction, write-through, fetch, lookup_tiers.

The disk tier runs on a real file (pytest's tmp_path); the shared tier on a real Valkey/Redis
server started by tests/tiers_server.py (skipped without the binary locally, never in CI).
Every round trip compares bytes against the blocks that were stored, on random data.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants
from kvmgr.tiers import DiskTier, SharedTier, TierNamespace

PAGES = (4 * 8 * 4, 4 * 16 * 4)  # float32 [blocks, 4, 8] and [blocks, 4, 16]


def _kv(seed: int, num_blocks: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, 4, 8, generator=gen),
        torch.randn(num_blocks, 4, 16, generator=gen),
    ]


def _ns(salt: bytes = b"") -> TierNamespace:
    return TierNamespace(
        model="tiny",
        page_bytes=PAGES,
        dtype_names=("float32", "float32"),
        block_size=4,
        tenant_salt=salt,
    )


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [hashlib.blake2b(tag + bytes([i]), digest_size=16).digest() for i in range(n)]


def _disk(tmp_path, name: str = "tier.bin") -> DiskTier:
    return DiskTier(tmp_path / name, slot_bytes=_ns().blob_bytes, num_slots=64, direct=False)


async def _store(mgr: OffloadManager, ids: list[int], keys: list[bytes]) -> None:
    future = mgr.swap_out(ids, keys)
    check_invariants(mgr)
    await mgr.step()
    await future
    check_invariants(mgr)


async def _load(mgr: OffloadManager, keys: list[bytes], req: str) -> list[int]:
    dst = mgr.allocate(req, len(keys))
    future = mgr.swap_in(keys, dst)
    await mgr.step()
    await future
    check_invariants(mgr)
    return dst


async def _settle(mgr: OffloadManager) -> None:
    for _ in range(50):  # background tier writes (real I/O): let them land
        await asyncio.sleep(0.01)
        if all(b.num_demoted + b.num_demote_failed for b, _ in mgr.tier_statistics()):
            return


@pytest.mark.asyncio
async def test_write_back_then_fetch_from_disk(tmp_path) -> None:
    kv = _kv(0)
    disk = _disk(tmp_path)
    try:
        config = ManagerConfig(num_cpu_blocks=4)
        async with OffloadManager(kv, config, tiers=[disk], tier_namespace=_ns()) as mgr:
            src = mgr.allocate("a", 8)
            keys = _keys(8)
            await _store(mgr, src[:4], keys[:4])
            await _store(mgr, src[4:], keys[4:])  # the CPU tier is full: evicts keys[:4]
            await _settle(mgr)
            assert mgr.lookup(keys) == 0  # keys[0] left the CPU tier
            assert await mgr.lookup_tiers(keys) == (0, (4,))
            assert await mgr.fetch(keys) == 4  # staged back from disk; keys[4:] evicted
            check_invariants(mgr)
            dst = await _load(mgr, keys[:4], "b")
            assert all(torch.equal(t[src[:4]], t[dst]) for t in kv)
            kinds = [(e.kind, e.tier) for e in mgr.take_events()]
            assert ("stored", "disk") in kinds
    finally:
        await disk.aclose()


@pytest.mark.asyncio
async def test_fetch_without_the_blocks_is_a_miss(tmp_path) -> None:
    kv = _kv(1)
    disk = _disk(tmp_path)
    try:
        config = ManagerConfig(num_cpu_blocks=4, tier_write_back=False)
        async with OffloadManager(kv, config, tiers=[disk], tier_namespace=_ns()) as mgr:
            src = mgr.allocate("a", 8)
            keys = _keys(8)
            await _store(mgr, src[:4], keys[:4])
            await _store(mgr, src[4:], keys[4:])  # evicted and dropped: write-back is off
            assert await mgr.fetch(keys) == 0
            check_invariants(mgr)
            assert mgr.peek(keys[4:]) == 4  # nothing was evicted for a miss
            assert mgr.tier_statistics()[0][0].num_demoted == 0
    finally:
        await disk.aclose()


@contextlib.asynccontextmanager
async def _two_instances(
    url: str, *instances: tuple[list[torch.Tensor], TierNamespace]
) -> AsyncIterator[tuple[OffloadManager, ...]]:
    """One manager per ``(caches, namespace)``, each with 8 CPU blocks writing through to its
    own ``SharedTier`` client of the server at ``url``; the clients are closed after."""
    config = ManagerConfig(num_cpu_blocks=8, tier_write_through=True)
    async with contextlib.AsyncExitStack() as stack:
        managers = []
        for kv, namespace in instances:
            shared = SharedTier(url, single_tenant=True)
            stack.push_async_callback(shared.aclose)
            mgr = OffloadManager(kv, config, tiers=[shared], tier_namespace=namespace)
            managers.append(await stack.enter_async_context(mgr))
        yield tuple(managers)


@pytest.mark.asyncio
async def test_two_instances_share_blocks_through_the_server(tier_server) -> None:
    """Instance A stores (write-through); instance B, with its own GPU and CPU tiers, fetches
    the same prefix from the server and gets A's bytes."""
    kv_a, kv_b = _kv(2), _kv(3)
    async with _two_instances(tier_server.url, (kv_a, _ns()), (kv_b, _ns())) as (a, b):
        src = a.allocate("a", 6)
        keys = _keys(6, b"shared")
        await _store(a, src, keys)
        await _settle(a)
        assert await b.lookup_tiers(keys) == (0, (6,))
        assert await b.fetch(keys) == 6
        check_invariants(b)
        dst = await _load(b, keys, "b")
        assert all(torch.equal(ta[src], tb[dst]) for ta, tb in zip(kv_a, kv_b))


@pytest.mark.asyncio
async def test_tenants_with_equal_prompts_share_nothing(tier_server) -> None:
    tenants = (_kv(4), _ns(b"t1")), (_kv(5), _ns(b"t2"))
    async with _two_instances(tier_server.url, *tenants) as (a, b):
        keys = _keys(4, b"same prompt")
        await _store(a, a.allocate("a", 4), keys)
        await _settle(a)
        assert await b.lookup_tiers(keys) == (0, (0,))
        assert await b.fetch(keys) == 0
        check_invariants(b)


@pytest.mark.asyncio
async def test_a_dead_server_gives_misses_and_the_instance_keeps_serving(tier_server) -> None:
    kv = _kv(6)
    shared = SharedTier(tier_server.url, deadline_s=0.5, connect_timeout_s=0.2, single_tenant=True)
    config = ManagerConfig(num_cpu_blocks=4, tier_write_through=True)
    try:
        async with OffloadManager(kv, config, tiers=[shared], tier_namespace=_ns()) as mgr:
            src = mgr.allocate("a", 8)
            keys = _keys(8, b"dead")
            tier_server.kill()
            await _store(mgr, src[:4], keys[:4])
            await _store(mgr, src[4:], keys[4:])  # evicts: the write-back fails, dropped
            await _settle(mgr)
            assert await mgr.fetch(keys) == 0  # a miss, no exception, no hang
            check_invariants(mgr)
            dst = await _load(mgr, keys[4:], "b")  # the CPU tier still serves
            assert all(torch.equal(t[src[4:]], t[dst]) for t in kv)
            assert mgr.tier_statistics()[0][1].num_errors > 0
    finally:
        await shared.aclose()


@pytest.mark.asyncio
async def test_a_fetch_reads_before_its_own_write_back_can_push_out_a_small_tier(tmp_path) -> None:
    # found by a fresh-user pass: with a disk tier of 4 slots, the fetch evicted 4 CPU blocks to
    # make room, their write-back ran first and the disk's LRU dropped the very blocks the fetch
    # was about to read (0 hits). The write-back of a fetch's victims now waits for its read.
    kv = _kv(7)
    disk = DiskTier(tmp_path / "small.bin", slot_bytes=_ns().blob_bytes, num_slots=4, direct=False)
    try:
        async with OffloadManager(
            kv, ManagerConfig(num_cpu_blocks=4), tiers=[disk], tier_namespace=_ns()
        ) as mgr:
            src = mgr.allocate("a", 8)
            keys = _keys(8, b"small")
            await _store(mgr, src[:4], keys[:4])
            await _store(mgr, src[4:], keys[4:])
            await _settle(mgr)
            assert await mgr.fetch(keys) == 4
            check_invariants(mgr)
            dst = await _load(mgr, keys[:4], "b")
            assert all(torch.equal(t[src[:4]], t[dst]) for t in kv)
    finally:
        await disk.aclose()


@pytest.mark.asyncio
async def test_a_store_during_the_fetch_ends_its_run_there(tmp_path) -> None:
    kv = _kv(5)
    disk = _disk(tmp_path)
    try:
        config = ManagerConfig(num_cpu_blocks=4)
        async with OffloadManager(kv, config, tiers=[disk], tier_namespace=_ns()) as mgr:
            src = mgr.allocate("a", 8)
            keys = _keys(8, b"race")
            await _store(mgr, src[:4], keys[:4])
            await _store(mgr, src[4:], keys[4:])  # keys[:4] written back to disk
            await _settle(mgr)
            again = mgr.allocate("b", 1)
            contains_many = disk.contains_many

            async def racing(stored_keys):  # a store of keys[1] while the fetch awaits
                present = await contains_many(stored_keys)
                invalidated = mgr.invalidate(keys[4:])
                assert invalidated == 4  # room for the store and the fetch
                mgr.store_many(again, keys[1:2])
                return present

            disk.contains_many = racing  # type: ignore[method-assign]
            assert await mgr.fetch(keys) == 1  # keys[0] promoted; keys[1] is the store's
            check_invariants(mgr)
            await mgr.step()
            check_invariants(mgr)
    finally:
        await disk.aclose()


@pytest.mark.asyncio
async def test_invalidate_leaves_the_lower_tiers_copy_until_the_tier_deletes_it(tmp_path) -> None:
    # docs/guides/tiers.md: invalidate and clear drop the CPU tier's keys only
    kv, disk = _kv(7), _disk(tmp_path)
    try:
        config = ManagerConfig(num_cpu_blocks=4, tier_write_through=True)
        async with OffloadManager(kv, config, tiers=[disk], tier_namespace=_ns()) as mgr:
            src, keys = mgr.allocate("a", 2), _keys(2, b"inv")
            await _store(mgr, src, keys)
            await _settle(mgr)
            assert mgr.invalidate(keys) == 2 and mgr.peek(keys) == 0
            assert await mgr.fetch(keys) == 2  # the disk's copy, staged again
            dst = await _load(mgr, keys, "b")
            assert all(torch.equal(t[src], t[dst]) for t in kv)
            assert mgr.clear() == 2
            assert await disk.delete_many(_ns().stored_keys(keys)) == 2
            assert await mgr.fetch(keys) == 0
            check_invariants(mgr)
    finally:
        await disk.aclose()
