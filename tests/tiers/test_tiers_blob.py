"""Blob format, namespaces, and TierBridge's protocol layer over an in-memory fake backend (unit
tests only; the real backends are tested in test_tiers_shared.py and test_tiers_disk.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from tiers_server import random_cpu_tensors

from kvmgr.errors import ConfigError, GeometryError, InvalidBlockError, InvalidKeyError, TierError
from kvmgr.pool.host_pool import HostKVPool
from kvmgr.tiers import PutResult, TierBridge, TierNamespace, TierStatistics
from kvmgr.tiers.base import check_keys
from kvmgr.tiers.blob import HEADER_BYTES, encode_rows, verify

PAGES = (1152, 584, 7)
NS = TierNamespace("m", PAGES, ("bfloat16", "uint8", "uint8"), 16)


def _blob(key: bytes, seed: int = 0) -> bytes:
    rows = np.random.default_rng(seed).integers(0, 256, (1, NS.blob_bytes), dtype=np.uint8)
    encode_rows(rows, [key], NS)
    return rows[0].tobytes()


def test_verify_rejects_every_damage() -> None:
    blob = _blob(b"k1")
    assert bytes(verify(b"k1", blob, NS)) == blob[HEADER_BYTES:]
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 100] ^= 1
    header_flip = bytearray(blob)
    header_flip[9] ^= 1  # inside the fingerprint
    for bad in (blob[:-1], blob + b"\0", bytes(flipped), bytes(header_flip), b"", b"KVT1", None):
        assert verify(b"k1", bad, NS) is None
    assert verify(b"k2", blob, NS) is None  # moved under another key
    other = TierNamespace("m", PAGES, ("bfloat16", "uint8", "uint8"), 32)
    assert verify(b"k1", blob, other) is None


def test_namespace_fields_all_enter_the_key() -> None:
    keys = [b"a", b"b"]
    variants = [
        NS,
        TierNamespace("m2", PAGES, NS.dtype_names, 16),
        TierNamespace("m", (1152, 584, 8), NS.dtype_names, 16),
        TierNamespace("m", PAGES, ("float16", "uint8", "uint8"), 16),
        TierNamespace("m", PAGES, NS.dtype_names, 32),
        TierNamespace("m", PAGES, NS.dtype_names, 16, tenant_salt=b"salt-Q7"),
    ]
    stored = [tuple(v.stored_keys(keys)) for v in variants]
    assert len(set(stored)) == len(variants)
    assert all(k.startswith(b"kvmgr:") and len(k) == 26 for k in stored[0])
    assert "salt-Q7" not in repr(variants[-1])  # the salt is not printed
    with pytest.raises(ConfigError):
        TierNamespace("m", (), (), 16)
    with pytest.raises(ConfigError):
        TierNamespace("m", (10, 0), ("a", "b"), 16)
    with pytest.raises(ConfigError):
        TierNamespace("m", (10,), ("a", "b"), 16)


class FakeBackend:
    """A dict: enough for the bridge's protocol layer (not a stand-in for a server)."""

    name = "fake"

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.fail = False

    async def put_many(self, keys: Sequence[bytes], blobs: Sequence[object]) -> PutResult:
        if self.fail:
            raise TierError("down")
        for k, b in zip(check_keys(keys, distinct=True), blobs):
            self.data[k] = bytes(memoryview(b))  # type: ignore[arg-type]
        return PutResult(np.ones(len(keys), bool), len(keys), 0, 0.0)

    async def get_many(self, keys: Sequence[bytes]) -> list[object]:
        if self.fail:
            raise TierError("down")
        return [self.data.get(k) for k in keys]

    async def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.array([k in self.data for k in keys], bool)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    async def aclose(self) -> None:
        pass

    def statistics(self) -> TierStatistics:
        return TierStatistics("fake", "memory")


def _pool_tensors(pages: tuple[int, ...], num_blocks: int, seed: int) -> list[torch.Tensor]:
    """HostKVPool's tensors (one region), random bytes; equal pages take the stacked path."""
    pool = HostKVPool(pages, num_blocks, lambda n: torch.empty(n, dtype=torch.uint8))
    gen = torch.Generator().manual_seed(seed)
    pool.region.copy_(torch.randint(0, 256, (pool.num_bytes,), dtype=torch.uint8, generator=gen))
    return pool.tensors


@pytest.mark.asyncio
@pytest.mark.parametrize("offload_bytes", [0, 1 << 30])
@pytest.mark.parametrize("layout", ["separate", "pool", "pool-equal-pages"])
async def test_bridge_gather_scatter_match_the_pages(offload_bytes: int, layout: str) -> None:
    ns = NS
    if layout == "separate":
        cpu = random_cpu_tensors(PAGES, 40, seed=7)
    elif layout == "pool":
        cpu = _pool_tensors(PAGES, 40, seed=7)
    else:
        ns = TierNamespace("m", (584,) * 5, ("uint8",) * 5, 16)
        cpu = _pool_tensors(ns.page_bytes, 40, seed=7)
    backend = FakeBackend()
    bridge = TierBridge(cpu, backend, ns, offload_bytes=offload_bytes)
    assert (bridge._pages._stack is not None) == (layout == "pool-equal-pages")
    rng = np.random.default_rng(8)
    src = rng.permutation(40)[:13]
    dst = rng.permutation(np.setdiff1d(np.arange(40), src))[:13]
    keys = [b"key%d" % i for i in range(13)]
    assert (await bridge.demote(keys, src)).all()
    # each stored blob is header + the block's pages of every tensor, in tensor order
    blob = backend.data[ns.stored_keys(keys[:1])[0]]
    expect = b"".join(t.numpy()[src[0]].tobytes() for t in cpu)
    assert blob[HEADER_BYTES:] == expect
    # a miss in the middle leaves its block untouched
    del backend.data[ns.stored_keys(keys[5:6])[0]]
    before = [t.numpy()[dst].copy() for t in cpu]
    hit = await bridge.promote(keys, dst)
    assert hit.tolist() == [i != 5 for i in range(13)]
    for t, old in zip(cpu, before):
        arr = t.numpy()
        assert np.array_equal(arr[dst[hit]], arr[src[hit]])
        assert np.array_equal(arr[dst[5]], old[5])
    stats = bridge.statistics()
    assert (stats.num_demoted, stats.num_promoted, stats.num_promote_misses) == (13, 12, 1)


@pytest.mark.asyncio
async def test_bridge_errors_become_misses_and_bad_input_raises(caplog) -> None:
    cpu = random_cpu_tensors(PAGES, 4, seed=9)
    backend = FakeBackend()
    bridge = TierBridge(cpu, backend, NS)
    backend.fail = True
    assert not (await bridge.demote([b"a"], [0])).any()
    assert not (await bridge.promote([b"a"], [0])).any()
    assert not (await bridge.promote([b"a"], [0])).any()
    assert bridge.statistics().num_errors == 3
    # one warning per run of failures, not one per step
    assert [r.levelname for r in caplog.records if "failed" in r.message] == ["WARNING"]
    backend.fail = False
    assert (await bridge.demote([b"a"], [0])).all()
    with pytest.raises(InvalidKeyError):
        await bridge.demote([b"a", b"a"], [0, 1])
    for keys, ids, err in [
        ([b"a"], [4], InvalidBlockError),
        ([b"a"], [-1], InvalidBlockError),
        ([b"a", b"b"], [1], InvalidKeyError),
        (["a"], [1], InvalidKeyError),
        ([b"a"], [[1]], InvalidBlockError),
    ]:
        with pytest.raises(err):
            await bridge.demote(keys, ids)
    with pytest.raises(InvalidBlockError):
        await bridge.promote([b"a", b"b"], [1, 1])
    with pytest.raises(GeometryError):
        TierBridge(random_cpu_tensors((8, 8, 8), 4, seed=1), backend, NS)


@pytest.mark.asyncio
async def test_concurrent_calls_on_one_bridge() -> None:
    # several demotes and promotes at once, all in worker threads, share the staging buffers
    ns = TierNamespace("m", (584,) * 4, ("uint8",) * 4, 16)
    cpu = _pool_tensors(ns.page_bytes, 64, seed=12)
    bridge = TierBridge(cpu, FakeBackend(), ns, offload_bytes=0)
    groups = [list(range(g * 8, g * 8 + 8)) for g in range(4)]
    keys = [[b"g%d-%d" % (g, i) for i in range(8)] for g in range(4)]
    stored = await asyncio.gather(*(bridge.demote(k, ids) for k, ids in zip(keys, groups)))
    assert all(s.all() for s in stored)
    dst = [list(range(32 + g * 8, 40 + g * 8)) for g in range(4)]
    hits = await asyncio.gather(*(bridge.promote(k, ids) for k, ids in zip(keys, dst)))
    assert all(h.all() for h in hits)
    for t in cpu:
        assert torch.equal(t[32:64], t[0:32])
