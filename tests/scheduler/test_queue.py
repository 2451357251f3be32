"""The swap queue's lanes (``kvmgr.scheduler.queue``): ids in part order, keys and request parts.

1. ``Lane``: small (list) and large (array) parts, interleaved, come back from ``arrays()`` in
   part order; a D2H lane lists its keyed stores' keys in that order and its request-level parts
   apart; an H2D lane keeps no keys.
2. One step whose D2H lane mixes per-call stores, a ``store_many`` and a preempt, and whose H2D
   lane mixes a load and a resume, on the host engine: every byte lands where the results say,
   completed stores are reported with their own CPU blocks, and the invariants hold.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.pool.block_table import Tier
from kvmgr.scheduler.queue import Kind, Lane, Part
from kvmgr.testing import check_invariants
from kvmgr.transfer.plan import Direction

K = [hashlib.blake2b(f"q{i}".encode(), digest_size=16).digest() for i in range(16)]


def _part(kind: Kind, gpu: Any, cpu: Any, keys: list[bytes] | None, req: Any = None) -> Part:
    return Part(kind, asyncio.get_running_loop().create_future(), None, gpu, cpu, keys, req)


@pytest.mark.asyncio
async def test_lane_keeps_part_order_keys_and_request_parts() -> None:
    lane = Lane(Direction.D2H)
    # a per-call store, a batched store, a preempt, another per-call store
    lane.add(_part(Kind.STORE, [7], [1], [K[0]]))
    lane.add(_part(Kind.STORE, np.array([3, 4]), np.array([9, 8]), [K[1], K[2]]))
    preempt = _part(Kind.PREEMPT, np.array([10, 11]), np.array([20, 21]), None, "r")
    lane.add(preempt)
    lane.add(_part(Kind.STORE, [5, 6], [2, 0], [K[3], K[4]]))
    gpu, cpu = lane.arrays()
    assert gpu.dtype == cpu.dtype == np.int64
    assert gpu.tolist() == [7, 3, 4, 10, 11, 5, 6]
    assert cpu.tolist() == [1, 9, 8, 20, 21, 2, 0]
    assert lane.keys == K[:5]
    assert lane.requests == [preempt]
    # an H2D lane keeps no keys, only its request parts apart
    loads = Lane(Direction.H2D)
    loads.add(_part(Kind.LOAD, [1], [2], [K[5]]))
    assert loads.keys == [] and loads.requests == []
    assert [a.tolist() for a in loads.arrays()] == [[1], [2]]


def _kv(num_blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [
        torch.randint(1, 256, (num_blocks, 96), dtype=torch.uint8, generator=gen),
        torch.randint(1, 256, (num_blocks, 4, 40), dtype=torch.uint8, generator=gen),
    ]


@pytest.mark.asyncio
async def test_mixed_lanes_complete_every_part() -> None:
    kv = _kv(24)
    config = ManagerConfig(num_cpu_blocks=32, engine="host")
    async with OffloadManager(kv, config) as mgr:
        stored: list[tuple[list[bytes], list[int]]] = []
        books = mgr._books  # record what completion returns as landed (for the write-through)
        complete = books.complete

        def recording(*args: Any, **kwargs: Any) -> Any:
            landed = complete(*args, **kwargs)
            if landed is not None:
                stored.append((list(landed.keys), landed.cpu_ids.tolist()))
            return landed

        books.complete = recording
        # a swapped-out request, to resume in the same step as a load
        mgr.allocate("old", 2)
        gone = mgr.preempt("old")
        await mgr.step()
        await gone
        # and a READY key to load
        src = mgr.allocate("src", 8)
        first = mgr.swap_out([src[0]], [K[0]])
        await mgr.step()
        await first
        stored.clear()
        # one step: D2H = store, store_many, preempt, store; H2D = load, resume
        mgr.allocate("moving", 3)
        moving = [t.clone() for t in kv]
        dst = mgr.allocate("dst", 1)
        futures = [
            mgr.swap_out([src[1]], [K[1]]),
            mgr.store_many(np.array(src[2:5]), K[2:5]),
            mgr.preempt("moving"),
            mgr.swap_out(src[5:7], K[5:7]),
            mgr.swap_in([K[0]], dst),
            mgr.resume("old"),
        ]
        report = await mgr.step()
        assert (report.d2h.batches, report.h2d.batches) == (1, 1)
        results = await asyncio.gather(*futures)
        # the stores are reported once, keys aligned with their own CPU blocks
        assert len(stored) == 1
        keys, ids = stored[0]
        assert keys == K[1:7]
        snapshot = mgr.snapshot()
        assert ids == [snapshot.keys[k].cpu_block_id for k in keys]
        # the bytes landed where the results say
        pool = mgr.cpu_pool.tensors
        for key, block in zip(keys, ids):
            gpu_block = src[1 + K[1:7].index(key)]
            assert all(
                torch.equal(p[block], t[gpu_block].reshape(-1).view(torch.uint8))
                for p, t in zip(pool, kv)
            )
        assert all(torch.equal(t[dst[0]], t[src[0]]) for t in kv)
        preempted = results[2]
        table = mgr.block_table("moving")
        assert [tier for tier, _ in table] == [Tier.CPU] * 3
        for (_, block), gpu_block in zip(table, preempted.gpu_block_ids):
            assert all(
                torch.equal(p[block], m[gpu_block].reshape(-1).view(torch.uint8))
                for p, m in zip(pool, moving)
            )
        assert [tier for tier, _ in mgr.block_table("old")] == [Tier.GPU] * 2
        check_invariants(mgr)
