"""A failed layerwise store raises ``LayerStoreError``, not the misleading ``LayerLoadError``.

Round 4, session 14 (leftovers14): every layerwise failure was a ``LayerLoadError``, a store's
too ("a layer of a layerwise load failed ... recompute instead"). A store now fails with
``LayerStoreError``; it subclasses ``LayerLoadError`` (older ``except LayerLoadError`` around a
store still catch it), and ``LayerwiseError`` is the base of both.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvmgr import (
    LayerLoadError,
    LayerStoreError,
    LayerwiseError,
    ManagerConfig,
    OffloadManager,
    TransferError,
)
from kvmgr.testing import FaultyEngine, check_invariants
from kvmgr.transfer.host import HostEngine

NUM_LAYERS = 4


def _keys(n: int, salt: int) -> list[bytes]:
    return [hashlib.blake2b(bytes([salt, i])).digest() for i in range(n)]


def _manager(engine: object) -> OffloadManager:
    caches = [torch.randn(16, 4, 8) for _ in range(2 * NUM_LAYERS)]  # K and V per layer
    config = ManagerConfig(num_cpu_blocks=16, engine="host")
    return OffloadManager(caches, config, engine=engine)  # type: ignore[arg-type]


def test_the_hierarchy_keeps_except_layer_load_error_working() -> None:
    assert issubclass(LayerStoreError, LayerLoadError)
    assert issubclass(LayerLoadError, LayerwiseError) and issubclass(LayerwiseError, TransferError)
    assert not issubclass(LayerLoadError, LayerStoreError)


@pytest.mark.asyncio
async def test_a_refused_store_group_fails_the_store_with_layer_store_error() -> None:
    engine = FaultyEngine(HostEngine(), refuse_batches={1})  # the store's second group
    async with _manager(engine) as mgr:
        keys = _keys(3, salt=1)
        store = mgr.store_layerwise(mgr.allocate("a", 3), keys, layers=2)
        for layer in range(NUM_LAYERS):
            store.save_layer(layer)
        with pytest.raises(LayerStoreError, match="could not submit"):
            await store
        assert mgr.peek(keys) == 0
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_an_aborted_store_fails_with_layer_store_error() -> None:
    async with _manager(HostEngine()) as mgr:
        store = mgr.store_layerwise(mgr.allocate("a", 3), _keys(3, salt=2), layers=2)
        store.save_layer(0)
        store.abort()
        with pytest.raises(LayerStoreError, match="1 of 4"):
            await store
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_failed_load_is_still_a_layer_load_error_and_no_store_error() -> None:
    engine = FaultyEngine(HostEngine(), fail_batches={2})  # batch 0: the store; 1-4: layers
    async with _manager(engine) as mgr:
        keys = _keys(3, salt=3)
        stored = mgr.store_many(mgr.allocate("a", 3), keys)
        await mgr.step()
        await stored
        load = mgr.load_layerwise(keys, mgr.allocate("b", 3), layers=2)
        with pytest.raises(LayerLoadError) as caught:
            await load
        assert not isinstance(caught.value, LayerStoreError)
        check_invariants(mgr)
