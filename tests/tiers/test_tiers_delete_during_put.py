"""A delete while a put of the key is in flight is never undone when the put lands (DiskTier,
SharedTier: docs/guides/tiers.md's "delete it from each tier" races write-back), and a random
program of the disk tier's slot table (puts, reads, deletes, evictions) keeps its invariants."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

import kvmgr.tiers.shared as shared_module
from kvmgr.tiers import DiskTier, SharedTier
from kvmgr.tiers._disk_slots import SlotTable

SLOT = 4096


def _tier(tmp_path, **kw) -> DiskTier:  # type: ignore[no-untyped-def]
    return DiskTier(tmp_path / "tier.bin", slot_bytes=SLOT, num_slots=8, direct=False, **kw)


@pytest.mark.asyncio
async def test_delete_during_write_stays_deleted(tmp_path) -> None:
    tier = _tier(tmp_path)
    gate = threading.Event()
    real_write = tier._write_run

    def slow_write(*args):  # type: ignore[no-untyped-def]
        gate.wait(5)
        return real_write(*args)

    tier._write_run = slow_write  # type: ignore[method-assign]
    put = asyncio.ensure_future(tier.put_many([b"k"], [b"x" * 100]))
    await asyncio.sleep(0.01)  # the write is in flight (pending)
    assert await tier.delete_many([b"k"]) == 0
    gate.set()
    await put
    # the key was deleted before its write landed: it must not become readable afterwards
    assert not (await tier.contains_many([b"k"])).any()
    assert tier.num_used == 0
    # and its slot went back to the free list (all 8 slots usable)
    tier._write_run = real_write  # type: ignore[method-assign]
    keys = [bytes([i]) for i in range(8)]
    res = await tier.put_many(keys, [b"y" * 10] * 8)
    assert res.num_stored == 8 and tier.statistics().num_evicted == 0
    await tier.aclose()


@pytest.mark.asyncio
async def test_shared_delete_during_put_stays_deleted(tier_server, monkeypatch) -> None:
    tier = SharedTier(tier_server.url, single_tenant=True)
    gate = threading.Event()
    real_put = shared_module.put_part

    def slow_put(*args, **kw):  # type: ignore[no-untyped-def]
        gate.wait(5)  # the SET reaches the server after the delete's UNLINK
        return real_put(*args, **kw)

    monkeypatch.setattr(shared_module, "put_part", slow_put)
    keys = [b"nu11-k", b"nu11-other"]
    await tier.delete_many(keys)
    put = asyncio.ensure_future(tier.put_many(keys[:1], [b"x" * 100]))
    await asyncio.sleep(0.05)
    assert await tier.delete_many(keys[:1]) == 0
    gate.set()
    await put
    assert not (await tier.contains_many(keys[:1])).any()
    # a put that starts after the delete is kept
    monkeypatch.setattr(shared_module, "put_part", real_put)
    assert (await tier.put_many(keys, [b"y" * 10] * 2)).num_stored == 2
    assert (await tier.contains_many(keys)).all()
    await tier.delete_many(keys)
    await tier.aclose()


def _check(table: SlotTable, num_slots: int, writing: dict[bytes, int]) -> None:
    """Every slot is in exactly one place: indexed, free, doomed (dropped while pinned) or
    being written."""
    indexed = [s for s, _n in table.index.values()]
    places = indexed + list(table._free) + list(table._doomed) + list(writing.values())
    assert sorted(places) == list(range(num_slots)), (indexed, table._free, table._doomed)
    assert set(table._doomed) <= set(table._pins)
    assert not set(table._free) & set(table._pins)


@pytest.mark.parametrize("seed", range(20))
def test_slot_table_random_program(seed: int) -> None:
    rng = random.Random(seed)
    n = 6
    table = SlotTable(n, None)
    writing: dict[bytes, int] = {}  # key -> slot of a write in flight
    pins: list[int] = []
    deleted: set[bytes] = set()  # keys dropped while their write was in flight
    for _ in range(300):
        op = rng.randrange(5)
        key = bytes([rng.randrange(10)])
        if op == 0 and not table.is_stored(key):  # a write starts
            slots, _ev = table.reserve(1)
            if slots and key not in writing:
                writing[key] = slots[0]
                table.pending.add(key)
        elif op == 1 and writing:  # a write ends
            k = rng.choice(list(writing))
            table.commit([(writing.pop(k), k, 10)], rng.random() < 0.8)
            assert k not in deleted or k not in table.index  # a delete is never undone
            deleted.discard(k)
        elif op == 2:
            pins.extend(r[0] for r in table.pin_reads([key]))
        elif op == 3 and pins:
            table.unpin(pins.pop(rng.randrange(len(pins))))
        elif op == 4:
            if key in writing:
                deleted.add(key)
            table.drop(key)
        _check(table, n, writing)
        assert not table.pending & set(table.index)
