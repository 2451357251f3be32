"""DiskTier through TierBridge on a real file (pytest's tmp_path): round trips, LRU, corruption,
restart, deadlines, bad input."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
from tiers_server import random_cpu_tensors

from kvmgr.errors import (
    ConfigError,
    GeometryError,
    InvalidArgumentError,
    InvalidKeyError,
    TierTimeoutError,
)
from kvmgr.tiers import DiskTier, TierBackend, TierBridge, TierNamespace

PAGES = (4096, 1152, 584)
NS = TierNamespace("test/model", PAGES, ("bfloat16", "bfloat16", "uint8"), 16)


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [b"blk-" + tag + i.to_bytes(4, "little") for i in range(n)]


def _blocks(tensors, ids):  # type: ignore[no-untyped-def]
    return [t.numpy()[ids].copy() for t in tensors]


def _equal(a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _tier(tmp_path, **kw) -> DiskTier:  # type: ignore[no-untyped-def]
    args = {"slot_bytes": NS.blob_bytes, "num_slots": 16}
    args.update(kw)
    return DiskTier(tmp_path / "tier.bin", **args)


@pytest.mark.asyncio
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("num_files", [1, 3])
async def test_round_trip(tmp_path, direct: bool, num_files: int) -> None:
    tier = _tier(tmp_path, direct=direct, num_files=num_files)
    assert isinstance(tier, TierBackend)
    assert tier.statistics().io_mode in ({"direct", "buffered"} if direct else {"buffered"})
    cpu = random_cpu_tensors(PAGES, 32, seed=1)
    # offload_bytes=0: gather/scatter run in worker threads even for this small batch
    bridge = TierBridge(cpu, tier, NS, offload_bytes=0)
    src, dst = [5, 1, 9, 30, 2, 17, 3, 4, 22, 11], [0, 6, 7, 8, 10, 12, 13, 14, 15, 16]
    assert (await bridge.demote(_keys(10), src)).all()
    assert (await tier.contains_many(NS.stored_keys(_keys(11)))).tolist() == [True] * 10 + [False]
    before = _blocks(cpu, [18, 19])
    assert (await bridge.promote(_keys(10), dst)).all()
    assert _equal(_blocks(cpu, dst), _blocks(cpu, src))
    assert _equal(_blocks(cpu, [18, 19]), before)
    stats = tier.statistics()
    assert (stats.num_stored, stats.num_hits, stats.num_corrupt) == (10, 10, 0)
    assert stats.bytes_written == stats.bytes_read == 10 * NS.blob_bytes
    # a key already stored is not rewritten
    again = await tier.put_many(NS.stored_keys(_keys(1)), [b"x"])
    assert again.stored.tolist() == [True] and again.num_bytes == 0
    await tier.aclose()


@pytest.mark.asyncio
async def test_lru_eviction_and_delete(tmp_path) -> None:
    tier = _tier(tmp_path, num_slots=4)
    cpu = random_cpu_tensors(PAGES, 8, seed=2)
    bridge = TierBridge(cpu, tier, NS)
    keys = _keys(6)
    assert (await bridge.demote(keys[:4], [0, 1, 2, 3])).all()
    # touch key 0: key 1 becomes the least recently used
    assert (await bridge.promote(keys[:1], [4])).all()
    assert (await bridge.demote(keys[4:6], [4, 5])).all()
    present = await tier.contains_many(NS.stored_keys(keys))
    assert present.tolist() == [True, False, False, True, True, True]
    assert tier.statistics().num_evicted == 2
    assert await tier.delete_many(NS.stored_keys([keys[0], keys[1]])) == 1
    assert tier.num_used == 3
    await tier.aclose()


@pytest.mark.asyncio
async def test_corrupted_slot_is_a_miss(tmp_path) -> None:
    tier = _tier(tmp_path, direct=False)
    cpu = random_cpu_tensors(PAGES, 8, seed=3)
    bridge = TierBridge(cpu, tier, NS)
    await bridge.demote(_keys(3), [0, 1, 2])
    # overwrite a few bytes of slot 1's payload in the file itself
    fd = os.open(tmp_path / "tier.bin", os.O_WRONLY)
    os.pwrite(fd, os.urandom(8), tier.slot_bytes * 1 + 1000)
    os.close(fd)
    before = _blocks(cpu, [3, 4, 5])
    hit = await bridge.promote(_keys(3), [3, 4, 5])
    assert hit.tolist() == [True, False, True]
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(_blocks(cpu, [3, 4, 5]), before))
    assert bridge.statistics().num_corrupt == 1  # the bridge verifies every blob read
    await tier.aclose()


@pytest.mark.asyncio
async def test_index_survives_restart(tmp_path) -> None:
    cpu = random_cpu_tensors(PAGES, 8, seed=4)
    tier = _tier(tmp_path)
    await TierBridge(cpu, tier, NS).demote(_keys(3), [0, 1, 2])
    await tier.aclose()
    # same geometry: the saved index is loaded; another geometry starts empty
    tier = _tier(tmp_path)
    assert tier.num_used == 3
    assert (await TierBridge(cpu, tier, NS).promote(_keys(3), [5, 6, 7])).all()
    assert _equal(_blocks(cpu, [5, 6, 7]), _blocks(cpu, [0, 1, 2]))
    await tier.aclose()
    assert _tier(tmp_path, num_slots=17).num_used == 0


@pytest.mark.asyncio
async def test_deadline_passes_then_write_lands(tmp_path) -> None:
    tier = _tier(tmp_path, deadline_s=0.05)
    cpu = random_cpu_tensors(PAGES, 4, seed=5)
    gate = threading.Event()
    real_write = tier._write_run

    def slow_write(*args):  # type: ignore[no-untyped-def]
        gate.wait(5)  # a stalled device: the write waits until the test releases it
        return real_write(*args)

    tier._write_run = slow_write  # type: ignore[method-assign]
    bridge = TierBridge(cpu, tier, NS)
    with pytest.raises(TierTimeoutError):
        await tier.put_many(NS.stored_keys(_keys(1)), [bytes(NS.blob_bytes)])
    assert not (await bridge.demote(_keys(1, b"b"), [0])).any()
    assert tier.statistics().num_timeouts == 2
    # not readable while in flight; after the device recovers the write is committed
    assert not (await tier.contains_many(NS.stored_keys(_keys(1, b"b")))).any()
    gate.set()
    await asyncio.gather(*tier._inflight)
    assert (await bridge.promote(_keys(1, b"b"), [1])).all()
    await tier.aclose()


@pytest.mark.asyncio
async def test_bad_input_changes_nothing(tmp_path) -> None:
    tier = _tier(tmp_path)
    cpu = random_cpu_tensors(PAGES, 4, seed=6)
    bridge = TierBridge(cpu, tier, NS)
    with pytest.raises(InvalidArgumentError):
        await tier.put_many([b"k"], [bytes(tier.slot_bytes + 1)])
    with pytest.raises(InvalidKeyError):
        await tier.put_many([b"k", b"k"], [b"a", b"b"])
    with pytest.raises(InvalidKeyError):
        await bridge.demote(_keys(2), [0])
    assert tier.num_used == 0 and tier.statistics().num_put_batches == 0
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "x", slot_bytes=0, num_slots=1)
    small = DiskTier(tmp_path / "small", slot_bytes=4096, num_slots=2)
    with pytest.raises(GeometryError, match="slots"):
        TierBridge(cpu, small, NS)
    await small.aclose()
    await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("direct", [True, False])
async def test_unaligned_blobs_round_trip(tmp_path, direct: bool) -> None:
    # plain bytes blobs (not the bridge's aligned, padded rows) go through the staging path
    from kvmgr.tiers.blob import encode_rows

    tier = _tier(tmp_path, direct=direct)
    keys = NS.stored_keys(_keys(5))
    rows = np.random.default_rng(11).integers(0, 256, (5, NS.blob_bytes), dtype=np.uint8)
    encode_rows(rows, keys, NS)
    blobs = [r.tobytes() for r in rows]
    assert (await tier.put_many(keys, blobs)).num_stored == 5
    got = await tier.get_many([keys[3], b"absent", *keys])
    assert got[1] is None
    assert [bytes(g) for g in got[2:]] == blobs and bytes(got[0]) == blobs[3]
    await tier.aclose()
