"""A layerwise store whose submitted group failed before the later layers were saved.

Round 4, session 13 (newuser14): ``save_layer`` after a group's copy had *failed* (not been
refused) did nothing, as documented, but nothing closed the operation either: the store's
future never resolved (until ``close``), its keys stayed PENDING and its GPU blocks busy, so an
owned pool never got them back from ``free``. ``save_layer`` now closes the operation once it
sees the failure: the store fails (``LayerLoadError``) as soon as the groups already submitted
ended, and the keys are dropped.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from kvmgr import LayerLoadError, ManagerConfig, OffloadManager
from kvmgr.testing import FaultyEngine, check_invariants
from kvmgr.transfer.host import HostEngine

NUM_LAYERS = 4


def _keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(bytes([99, i])).digest() for i in range(n)]


@pytest.mark.asyncio
@pytest.mark.parametrize("failing", [0, 1, 2], ids=lambda g: f"group{g}")
async def test_a_failed_group_fails_the_store_once_the_forward_saved_on(failing: int) -> None:
    caches = [torch.randn(16, 4, 8) for _ in range(2 * NUM_LAYERS)]  # K and V per layer
    keys = _keys(3)
    engine = FaultyEngine(HostEngine(), fail_batches={failing})
    config = ManagerConfig(num_cpu_blocks=16, engine="host")
    async with OffloadManager(caches, config, engine=engine) as mgr:
        blocks = mgr.allocate("a", 3)
        store = mgr.store_layerwise(blocks, keys, layers=2)  # one group per layer
        for layer in range(NUM_LAYERS):
            store.save_layer(layer)
            for _ in range(100):  # let the failed group's completion arrive first
                if store.batches.failed or layer != failing:
                    break
                await asyncio.sleep(0.005)
        assert store.batches.failed
        with pytest.raises(LayerLoadError):
            await asyncio.wait_for(asyncio.shield(store.future), 5)  # hung before the fix
        assert mgr.peek(keys) == 0
        assert mgr.snapshot().gpu_busy == {}
        mgr.free("a")
        check_invariants(mgr)
        assert mgr.statistics().gpu_blocks_free == 16  # every block back in the owned pool
