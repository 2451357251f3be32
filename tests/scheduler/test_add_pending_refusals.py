"""``CpuTier.add_pending`` refuses a key twice with nothing changed, and the per-call settle
skips keys indexed since their call (the stress finding "key ... is already tracked by the arc
policy": the index was written before the policy raised, leaving half a store behind)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, SwapResult
from kvmgr.errors import BlockStateError
from kvmgr.manager import CpuState
from kvmgr.scheduler.cpu_tier import CpuTier
from kvmgr.testing import check_invariants

K = [f"pend-{i}".encode() for i in range(6)]


def _books(tier: CpuTier) -> tuple[dict[bytes, int], bytes, int, int, dict[bytes, bytes | None]]:
    return (
        dict(tier.index),
        bytes(tier.state),
        tier.num_pending,
        len(tier.policy),
        tier.chains.parent,
    )


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "reuse"])
@pytest.mark.parametrize("as_array", [False, True])
def test_a_key_indexed_already_is_refused_with_nothing_changed(policy: str, as_array: bool) -> None:
    tier = CpuTier(8, policy, lambda keys: None)
    tier.add_pending(K[:2], tier.make_room_small(2, ()), [None, K[0]])
    before = _books(tier)
    ids = tier.make_room(2, ()) if as_array else tier.make_room_small(2, ())
    with pytest.raises(BlockStateError, match="indexed already"):
        tier.add_pending([K[2], K[1]], ids, [None, K[2]])
    assert _books(tier) == before


@pytest.mark.parametrize("policy", ["arc", "s3fifo", "reuse"])
def test_a_policy_that_refuses_leaves_the_index_unchanged(policy: str) -> None:
    tier = CpuTier(8, policy, lambda keys: None)
    tier.policy.insert([K[3]], [None])  # tracked by the policy, not indexed (the desync)
    before = _books(tier)
    with pytest.raises(BlockStateError, match="already tracked"):
        tier.add_pending([K[3]], tier.make_room_small(1, ()), [None])
    assert _books(tier) == before


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
async def test_a_key_indexed_between_record_and_settle_is_skipped(policy: str) -> None:
    kv = [torch.randint(1, 255, (8, 64), dtype=torch.uint8)]
    config = ManagerConfig(num_cpu_blocks=8, engine="host", policy=policy)
    async with OffloadManager(kv, config) as mgr:
        gpu = mgr.allocate("r", 3)
        recorded = mgr.swap_out(gpu[0:2], K[0:2])
        other = mgr.swap_out(gpu[2:3], K[2:3])
        assert len(mgr._deferred) == 2
        books = mgr._books  # a path that indexes keys without settling (a promote)
        ids = books.prepare_promote([K[1]], ())
        books.complete_promote([K[1]], ids, np.ones(1, dtype=bool))
        snap = mgr.snapshot()  # settles: K1 is skipped, not indexed twice
        check_invariants(mgr)
        assert snap.keys[K[0]].state is CpuState.PENDING
        assert snap.keys[K[1]].cpu_block_id == int(ids[0])
        await mgr.step()
        first, second = await recorded, await other
        assert isinstance(first, SwapResult) and first.num_blocks == 1 and first.num_skipped == 1
        assert second.num_blocks == 1
        await asyncio.sleep(0)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_one_block_calls_with_a_key_indexed_since_are_each_prepared_on_their_own() -> None:
    kv = [torch.randint(1, 255, (8, 64), dtype=torch.uint8)]
    config = ManagerConfig(num_cpu_blocks=8, engine="host", policy="arc")
    async with OffloadManager(kv, config) as mgr:
        gpu = mgr.allocate("r", 2)
        calls = [mgr.swap_out(gpu[0:1], K[0:1]), mgr.swap_out(gpu[1:2], K[1:2])]
        assert mgr._deferred.ends is None  # one block per call
        ids = mgr._books.prepare_promote([K[0]], ())
        mgr._books.complete_promote([K[0]], ids, np.ones(1, dtype=bool))
        mgr.snapshot()
        check_invariants(mgr)
        await mgr.step()
        first, second = [await c for c in calls]
        assert (first.num_blocks, first.num_skipped, second.num_blocks) == (0, 1, 1)
        check_invariants(mgr)
