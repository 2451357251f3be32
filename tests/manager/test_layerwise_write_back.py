"""A layerwise store that evicts READY blocks writes them back to the lower tier with THEIR
bytes: they are staged before its groups overwrite the CPU blocks.

The flush stages evicted blocks only when work is queued, and ``store_layerwise`` flushes an
empty queue, so its victims were staged after its copies: the disk tier got the new store's
bytes under the evicted keys, with valid checksums, and a later ``fetch`` served them as the
evicted keys' KV (new user, round 4 session 9).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants
from kvmgr.tiers import DiskTier, TierNamespace

KEYS = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(8)]


@pytest.mark.asyncio
@pytest.mark.parametrize("layerwise", [True, False])
async def test_evicted_blocks_reach_the_lower_tier_with_their_own_bytes(
    tmp_path: Path, layerwise: bool
) -> None:
    gen = torch.Generator().manual_seed(9)
    kv = [torch.randn(16, 4, 8, generator=gen), torch.randn(16, 4, 16, generator=gen)]
    ns = TierNamespace(model="m", page_bytes=(128, 256), dtype_names=("float32",) * 2,
                       block_size=4)  # fmt: skip
    disk = DiskTier(tmp_path / "tier.bin", slot_bytes=ns.blob_bytes, num_slots=16, direct=False)
    config = ManagerConfig(num_cpu_blocks=4, engine="host")  # write-back on eviction
    async with OffloadManager(kv, config, tiers=[disk], tier_namespace=ns) as mgr:
        src = mgr.allocate("a", 8)
        first = mgr.store_many(src[:4], KEYS[:4])
        await mgr.step()
        await first
        if layerwise:  # evicts the first four, then writes their CPU blocks layer by layer
            store = mgr.store_layerwise(src[4:], KEYS[4:])
            for layer in range(store.num_layers):
                store.save_layer(layer)
        else:
            store = mgr.store_many(src[4:], KEYS[4:])
            await mgr.step()
        await store
        await mgr.drain_tiers(10)
        assert mgr.invalidate(KEYS[4:]) == 4
        assert await mgr.fetch(KEYS[:4]) == 4  # from the disk tier
        dst = mgr.allocate("b", 4)
        load = mgr.load_many(KEYS[:4], dst)
        await mgr.step()
        await load
        assert all(torch.equal(t[dst], t[src[:4]]) for t in kv)  # the first four's bytes
        check_invariants(mgr)
    await disk.aclose()
