"""The calls of ``OffloadManager`` that do not wait for the step: layerwise loads and stores,
and the lower tiers (fetch, lookup, drain, statistics).

Private to ``kvmgr.manager``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvmgr.manager.core import ManagerCore, check_timeout
from kvmgr.manager.layerwise import start_load, start_store
from kvmgr.reports import (
    LoadResult,
    StoreResult,
)
from kvmgr.transfer.layerwise import LayerwiseLoad, LayerwiseStore

__all__ = ["StagedCalls"]


class StagedCalls(ManagerCore):
    """Layerwise swaps and lower-tier calls (mixed into ``OffloadManager``)."""

    # ------------------------------------------------------------------ layerwise

    def load_layerwise(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Any,
        *,
        layers: Sequence[int] | int | None = None,
        min_group_bytes: int = 0,
        max_groups: int | None = None,
    ) -> LayerwiseLoad:
        """Load READY keys into GPU blocks layer by layer, submitted NOW (not at ``step()``).

        What is queued is flushed first; then one batch per layer group is submitted on the load
        stream, group 0 first (``kvmgr.transfer.layerwise``). Call ``load.wait_layer(i)`` right
        before layer ``i`` reads the blocks (a stream wait on the device; the host does not
        block), and ``await load`` (``LoadResult``) before freeing or reusing anything.

        Args:
            keys, gpu_block_ids: as ``load_many``.
            layers: the layer of each KV tensor (non-decreasing from 0), an int ``k`` for ``k``
                consecutive tensors per layer (``2``: K and V tensors), or ``None``: one tensor
                per layer.
            min_group_bytes: layers are merged with the next until a group holds this many bytes
                per block (``0``: one batch per layer).
            max_groups: at most this many batches (layers merged by size; each batch costs
                host time to submit).

        Raises:
            LayerOrderError: bad ``layers`` or ``min_group_bytes``.
            KVMgrError: as ``load_many``. A refused group does not raise: the load fails
                (``LayerLoadError``) and every ``wait_layer`` raises.
        """
        loop = self._check_open()
        worker = self._local_worker("load_layerwise")
        groups, layouts = self._layer_layouts.groups(worker, layers, min_group_bytes, max_groups)
        future: asyncio.Future[LoadResult] = loop.create_future()
        part = self._books.prepare_load(keys, gpu_block_ids, future, batched=True)
        return start_load(self._flusher, worker, loop, layouts, groups, part, self._is_open)

    def store_layerwise(
        self,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        *,
        parents: Sequence[bytes | None] | None = None,
        layers: Sequence[int] | int | None = None,
        min_group_bytes: int = 0,
        max_groups: int | None = None,
    ) -> LayerwiseStore:
        """Store GPU blocks layer by layer as the forward writes them (``save_kv_layer``).

        Reserves like ``store_many`` (the keys become PENDING now); ``store.save_layer(i)``
        after layer ``i`` wrote its KV submits that layer's group, fenced on the compute stream
        at that point. ``await store`` (``StoreResult``) resolves after the last layer.
        ``store.abort()`` (or closing the manager) fails the layers not saved yet. A refused or
        failed group does not raise here: ``await store`` raises ``LayerStoreError`` and the
        keys are dropped.

        Args:
            gpu_block_ids, keys, parents: as ``store_many``.
            layers, min_group_bytes, max_groups: as ``load_layerwise``.

        Raises:
            LayerOrderError: bad ``layers`` or ``min_group_bytes``.
            PoolExhaustedError: no room in the CPU tier (no backpressure here); nothing changed.
            KVMgrError: as ``store_many``.
        """
        loop = self._check_open()
        worker = self._local_worker("store_layerwise")
        groups, layouts = self._layer_layouts.groups(worker, layers, min_group_bytes, max_groups)
        future: asyncio.Future[StoreResult] = loop.create_future()
        part = self._books.prepare_store(gpu_block_ids, keys, parents, future, batched=True)
        store = start_store(self._flusher, worker, loop, layouts, groups, part, self._is_open)
        self._layerwise_stores = [s for s in self._layerwise_stores if not s.batches.handle.done()]
        self._layerwise_stores.append(store)
        return store

    # ------------------------------------------------------------------ lower tiers

    async def fetch(self, keys: Sequence[bytes]) -> int:
        """Stage the lower tiers' blocks of ``keys`` into the CPU tier (after its ready prefix,
        tier by tier: one batched read per tier, every blob verified) and return the new
        ready-prefix length; then ``swap_in``/``load_many`` the prefix as usual. A miss, a
        corrupt value or a failing tier ends the prefix there (recompute the rest); it never
        raises for a tier failure. So does a key still PENDING (another fetch staging it, or a
        store): of two fetches of one prefix at once, the later one stops there (``gather``
        them, then ``peek`` or ``lookup``). Without lower tiers: ``lookup`` without the touch.

        Raises:
            InvalidKeyError, ClosedError, EventLoopError: bad keys, closed, no running loop.
        """
        self._check_open()
        if self._tiers is None:
            return self._books.lookup(keys, touch=False)
        return await self._tiers.fetch(keys)

    async def lookup_tiers(self, keys: Sequence[bytes]) -> tuple[int, tuple[int, ...]]:
        """Where the prefix of ``keys`` is: the CPU tier's ready prefix, then, for each lower
        tier in order, how many of the following keys it holds (one batched ``contains_many``
        each; a hint: a later ``fetch`` may still miss). Touches nothing.

        Raises:
            InvalidKeyError, ClosedError, EventLoopError: as ``fetch``.
        """
        self._check_open()
        if self._tiers is None:
            return self._books.lookup(keys, touch=False), ()
        return await self._tiers.lookup(keys)

    async def drain_tiers(self, timeout_s: float | None = None) -> None:
        """Wait (up to ``timeout_s`` seconds; ``None``: no bound) until the lower tiers'
        background writes started so far (write-back of evicted blocks, write-through) ended.
        For replays that must not depend on I/O timing (``kvmgr simulate``); a serving loop
        never needs it. No-op without lower tiers.

        Raises:
            ClosedError, EventLoopError: closed, or no running loop.
            InvalidArgumentError: ``timeout_s`` is not ``None`` or a finite number >= 0.
        """
        timeout_s = check_timeout(timeout_s)
        self._check_open()
        if self._tiers is not None:
            self._tiers.write_evicted(self._books.take_evicted(), asyncio.get_running_loop())
            await self._tiers.drain(timeout_s)

    def tier_statistics(self) -> list[tuple[Any, Any]]:
        """Per lower tier: ``(BridgeStatistics, TierStatistics)`` (totals)."""
        if self._tiers is None:
            return []
        return [(b.statistics(), b.backend.statistics()) for b in self._tiers.bridges]
