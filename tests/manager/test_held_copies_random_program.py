"""Held copies under a random program (newuser12): the engine gates every batch (released a
few at a time, some failing), requests are freed while their stores and loads are gated, and
new requests write their own bytes into whatever blocks they are given. Every completed load
must return the bytes of its keys (a block handed out while a gated copy still reads or
writes it would show there), and at the end the statistics must add up."""

from __future__ import annotations

import asyncio
import hashlib
import random

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import KVMgrError
from kvmgr.testing import ScriptedEngine, check_invariants
from kvmgr.transfer.host import HostEngine

PAGE = (2, 8)


def fill(key: bytes) -> torch.Tensor:
    """The bytes stored under ``key`` (float32 ``PAGE``), the same at every store."""
    digest = np.frombuffer(hashlib.blake2b(key, digest_size=8).digest(), dtype=np.uint8)
    return torch.from_numpy(
        np.resize(digest.astype(np.float32), PAGE[0] * PAGE[1]).reshape(PAGE) + 1
    )


class _Program:
    def __init__(self, seed: int, mgr: OffloadManager, kv: list[torch.Tensor]) -> None:
        self.rng, self.mgr, self.kv = random.Random(seed), mgr, kv
        self.universe = [hashlib.blake2b(b"%d-%d" % (seed, i)).digest() for i in range(200)]
        self.recent = [self.universe[:5]]
        self.loads: list = []  # type: ignore[type-arg]  # (future, keys, ids, request, freed)
        self.live: set[str] = set()
        self.rid = self.checked = 0

    def store(self) -> None:
        rng, u = self.rng, self.universe
        start, n = rng.randrange(0, 190), rng.randint(1, 14)
        keys = u[start : start + n] if rng.random() < 0.7 else rng.sample(u, n)
        self.rid += 1
        req = f"s{self.rid}"
        blocks = self.mgr.allocate(req, len(keys))
        self.live.add(req)
        for t in self.kv:
            t[blocks] = torch.stack([fill(k) for k in keys])
        ids = np.asarray(blocks, dtype=np.int64) if rng.random() < 0.6 else list(blocks)
        self.mgr.store_many(ids, keys)
        self.recent.append(keys)
        if rng.random() < 0.5:  # freed while its copy is gated
            self.free(req)

    def load(self) -> None:
        base = self.rng.choice(self.recent[-8:])
        keys = base[self.rng.randrange(len(base)) :] if self.rng.random() < 0.5 else base
        hits = self.mgr.lookup(keys)
        if not hits:
            return
        self.rid += 1
        req = f"l{self.rid}"
        dst = self.mgr.allocate(req, hits)
        self.live.add(req)
        for t in self.kv:
            t[dst] = -7.0
        future = self.mgr.load_many(keys[:hits], np.asarray(dst, dtype=np.int64))
        freed = self.rng.random() < 0.3
        if freed:
            self.free(req)
        self.loads.append((future, keys[:hits], list(dst), req, freed))

    def free(self, req: str) -> None:
        self.mgr.free(req)
        self.live.discard(req)

    def check_done(self) -> None:
        pending = []
        for future, keys, dst, req, freed in self.loads:
            if not future.done():
                pending.append((future, keys, dst, req, freed))
                continue
            if not future.cancelled() and future.exception() is None and not freed:
                self.checked += 1
                for t in self.kv:
                    for b, k in zip(dst, keys, strict=True):
                        assert torch.equal(t[b], fill(k)), f"wrong KV in block {b}"
            if req in self.live:
                self.free(req)
        self.loads = pending


async def _run(seed: int) -> int:
    rng = random.Random(seed)
    num_gpu_blocks = rng.choice([40, 64, 128])
    kv = [torch.zeros(num_gpu_blocks, *PAGE) for _ in range(2)]
    engine = ScriptedEngine(HostEngine(), hold=True, fail_rate=rng.choice([0, 0.15]), seed=seed)
    config = ManagerConfig(
        num_cpu_blocks=rng.choice([6, 12, 30]), policy=rng.choice(["lru", "arc", "s3fifo"])
    )
    async with OffloadManager(kv, config, engine=engine) as mgr:
        p = _Program(seed, mgr, kv)
        for _ in range(rng.randint(10, 40)):
            for _ in range(rng.randint(0, 5)):
                op = rng.random()
                try:
                    if op < 0.4:
                        p.store()
                    elif op < 0.7:
                        p.load()
                    elif op < 0.78:
                        start = rng.randrange(0, 190)
                        mgr.invalidate(p.universe[start : start + rng.randint(1, 6)])
                    elif op < 0.86 and p.live:
                        p.free(rng.choice(sorted(p.live)))
                    elif op < 0.92 and p.loads:
                        rng.choice(p.loads)[0].cancel()
                    else:
                        mgr.clear()
                except KVMgrError:
                    pass
            await mgr.step()
            if (r := rng.random()) < 0.5:
                engine.complete_next(rng.randint(1, 4))
            elif r < 0.85:
                engine.release()
                engine.hold()
            await asyncio.sleep(0.001)
            check_invariants(mgr)
            p.check_done()
        engine.release()
        for _ in range(200):
            if not p.loads and not mgr.statistics().batches_in_flight:
                break
            await mgr.step()
            await asyncio.sleep(0.005)
            p.check_done()
        check_invariants(mgr)
        st, per_block = mgr.statistics(), 2 * PAGE[0] * PAGE[1] * 4
        assert st.stores_queued == st.stores_completed + st.stores_failed
        assert st.loads_queued == st.loads_completed + st.loads_failed
        assert (
            st.batches_in_flight,
            st.queued_swaps,
            st.cpu_keys_pending,
            st.cpu_keys_loading,
        ) == (0, 0, 0, 0)
        assert (st.bytes_d2h, st.bytes_h2d) == (
            st.stores_completed * per_block,
            st.loads_completed * per_block,
        )
        assert st.cpu_keys_ready == len(mgr.snapshot().keys)
        return p.checked


@pytest.mark.asyncio
async def test_held_copies_never_hand_out_a_block_in_use() -> None:
    assert sum([await _run(seed) for seed in range(30)]) > 40
