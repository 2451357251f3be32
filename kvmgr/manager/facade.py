"""OffloadManager: the asyncio facade. It HOLDS a Bookkeeper, a swap queue and an engine.

Swaps only queue work and return an ``asyncio.Future`` (one per call, whatever its number of
blocks); ``step()`` (or, with ``flush="tick"``, the end of the event-loop tick) turns the queue
into one plan per direction and submits it. The engine reports completion from its own thread;
the manager applies the bookkeeping of the whole batch on the loop thread
(``call_soon_threadsafe``), then resolves the batch's futures, in submission order.

Cancelling a task that awaits a swap's future cancels that future, never the copy: the copy
runs to its end and the bookkeeping completes as if nobody had cancelled. ``wait()`` shields
the future, so cancelling it leaves the future intact. docs/architecture.md draws the life of a
swap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import (
    ClosedError,
    ConfigError,
    EventLoopError,
    InvalidArgumentError,
    PoolExhaustedError,
    TransferTimeoutError,
)
from kvmgr.events.tokens import check_token_ids
from kvmgr.hooks import StepContext, StepHook
from kvmgr.manager.backpressure import WaitingFuture, WaitingStore
from kvmgr.manager.build import Parts, build_local, build_ranked
from kvmgr.manager.layerwise import LayerLayouts, start_load, start_store
from kvmgr.manager.snapshot import ManagerSnapshot, take_snapshot
from kvmgr.pool.block_table import Tier
from kvmgr.pool.layout import KVLayout
from kvmgr.reports import (
    KVEvent,
    LoadResult,
    ManagerStatistics,
    StepReport,
    StoreResult,
    SwapResult,
)
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.jobs import Direction
from kvmgr.scheduler.keys import check_keys
from kvmgr.scheduler.queue import Part
from kvmgr.transfer.engine import TransferEngine
from kvmgr.transfer.layerwise import LayerwiseLoad, LayerwiseStore
from kvmgr.worker import TransferWorker

__all__ = ["OffloadManager"]


class OffloadManager:
    """Manages a KV cache across GPU memory and a CPU tier; embed one per serving loop.

    Args:
        gpu_kv_caches: the KV tensors, each with ``num_gpu_blocks`` as dim 0 and contiguous
            blocks (``[num_blocks, ...]``; viewed as ``[num_blocks, page_bytes]``). CUDA tensors
            for the CUDA engines, CPU tensors for the host engine. Not copied: kept alive here,
            and they must not be resized or re-pointed afterwards (a flush that finds them moved
            fails its batch with ``StaleKVTensorError``).
        config: settings; ``num_cpu_blocks`` is required.
        hooks: step hooks run in order by ``step()``.
        engine: an engine instance to use instead of ``config.engine`` (for example a
            ``kvmgr.testing.FaultyEngine``); the manager closes it on ``close()``.
        tiers: lower tiers under the CPU tier, in order (``kvmgr.tiers.DiskTier``,
            ``kvmgr.tiers.SharedTier`` or any ``TierBackend``); the caller closes them. See
            ``fetch``, ``lookup_tiers`` and docs/tiers.md.
        tier_namespace: the ``kvmgr.tiers.TierNamespace`` folded into every stored key (model,
            layout, tenant salt); ``None`` = this layout, model ``"unnamed"``, no salt.

    Ownership of GPU blocks: with ``manage_gpu_blocks=True`` (the default) the manager owns
    the GPU pool and every GPU block id a swap names must be held by a request (handed out by
    ``allocate``); naming any other block raises ``InvalidBlockError`` before anything changes,
    so no allocation can hand out a block a queued copy still reads or writes. With
    ``manage_gpu_blocks=False`` the caller owns the blocks and must not reuse a block before
    the swap's future resolved.

    Raises:
        GeometryError: the tensors cannot be managed, or do not suit the engine's device.
        ConfigError: invalid settings, or ``engine``, ``hooks``, ``tiers`` or ``tier_namespace``
            of the wrong type (raised before any memory is allocated).
        HostMemoryError: the CPU tier's memory could not be allocated.

    Use it as ``async with OffloadManager(...) as mgr:``, or call ``await mgr.aclose()``.
    Every public method validates its input and raises before changing any state.
    """

    def __init__(
        self,
        gpu_kv_caches: Sequence[torch.Tensor],
        config: ManagerConfig,
        *,
        hooks: Sequence[StepHook] = (),
        engine: TransferEngine | None = None,
        tiers: Sequence[Any] = (),
        tier_namespace: Any = None,
    ) -> None:
        if not isinstance(config, ManagerConfig):
            raise ConfigError(f"expected a ManagerConfig, got {type(config).__name__}")
        for hook in hooks:
            if not isinstance(hook, StepHook):
                raise ConfigError(f"expected a StepHook, got {type(hook).__name__}")
        self._adopt(
            build_local(gpu_kv_caches, config, engine, tiers, tier_namespace, self._enqueue),
            config,
            hooks,
        )

    @classmethod
    def over_ranks(cls, group: Any, config: ManagerConfig) -> OffloadManager:
        """A manager whose copies run in the rank processes of ``group`` (tensor parallelism).

        The manager is the scheduler side only: the same keyed and request-level API, the
        same futures, bookkeeping and invariants; every job goes to every rank
        (``kvmgr.transport.RankGroup``) and completes when all of them reported success.
        Results count one rank's bytes (``SwapResult.num_bytes``); step reports count every
        rank's. A rank that fails a job fails it on every rank (``RankError`` naming it); a
        rank that dies or misses the group's deadline stops the offload: jobs in flight and
        every later swap fail with ``RankError`` / ``RankTimeoutError``, nothing hangs. No
        hooks, no lower tiers; ``engine``, ``gpu_layout`` and ``cpu_pool`` are ``None``.
        The caller closes the group after the manager.

        Raises:
            ConfigError: invalid settings.
        """
        if not isinstance(config, ManagerConfig):
            raise ConfigError(f"expected a ManagerConfig, got {type(config).__name__}")
        manager = cls.__new__(cls)
        manager._adopt(build_ranked(group, config, manager._enqueue), config, ())
        return manager

    def _adopt(self, parts: Parts, config: ManagerConfig, hooks: Sequence[StepHook]) -> None:
        self.config = config
        self._worker = parts.worker
        self._scheduler = parts.scheduler
        self._books = parts.scheduler.books
        self._queue = parts.scheduler.queue
        self._flusher = parts.flusher
        self._transport = parts.flusher.transport
        self._room = parts.room
        self._tiers = parts.tiers
        self._hooks = list(hooks)
        self._loop: asyncio.AbstractEventLoop | None = None  # the one holder of the loop
        self._layerwise_stores: list[LayerwiseStore] = []  # aborted at close if unfinished
        self._layer_layouts = LayerLayouts()
        self._flush_on_tick = config.flush == "tick"
        self._tick_scheduled = False
        self._closing = False
        self._closed = False
        self._step = 0

    @property
    def engine(self) -> TransferEngine:
        """The local worker's transfer engine (``None`` over ranks)."""
        return None if self._worker is None else self._worker.engine  # type: ignore[return-value]

    @property
    def gpu_layout(self) -> KVLayout:
        """The local worker's GPU KV layout (``None`` over ranks)."""
        return None if self._worker is None else self._worker.gpu_layout  # type: ignore[return-value]

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> OffloadManager:
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether ``close``/``aclose`` has been called."""
        return self._closed

    @property
    def policy(self) -> Any:
        """The CPU tier's eviction policy (read it; do not drive it)."""
        return self._books.cpu.policy

    @property
    def cpu_pool(self) -> Any:
        """The CPU tier's memory (``HostKVPool``: one ``uint8 [num_cpu_blocks, page_bytes]``
        view per KV tensor)."""
        return None if self._worker is None else self._worker.cpu_pool

    async def aclose(self, timeout_s: float | None = 30.0) -> None:
        """Close: fail queued swaps with ``ClosedError``, wait (up to ``timeout_s`` seconds) for
        the copies in flight and apply their bookkeeping, then close the engine. Idempotent."""
        if self._closed:
            return
        self._closing = True  # from here on, new swaps raise ClosedError
        self._abort_layerwise()
        self._room.fail(ClosedError("manager closed while the store waited for room"))
        if self._queue.in_flight:
            await self._transport.wait(list(self._queue.in_flight), timeout_s)
            await asyncio.sleep(0)  # let completion callbacks scheduled by the engine run
        if self._tiers is not None:
            self._tiers.write_evicted(self._books.take_evicted(), asyncio.get_running_loop())
            await self._tiers.drain(timeout_s)
        self.close(timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Synchronous close: fail queued swaps, wait for the engine (bounded), then settle
        every in-flight batch here. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._abort_layerwise()
        self._flusher.fail_queued(ClosedError("manager closed before the swap was submitted"))
        try:
            self._transport.close(timeout_s)  # may raise TransferTimeoutError: copies running
        finally:
            self._flusher.settle_at_close()
            self._room.fail(ClosedError("manager closed while the store waited for room"))
            self._books.events.cleared()
            self._books.events.close()

    def _check_open(self) -> asyncio.AbstractEventLoop:
        if self._closed or self._closing:
            raise ClosedError("the manager is closed")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise EventLoopError(
                "swaps need a running asyncio event loop: call them from a coroutine "
                "(for example inside asyncio.run(main()))"
            ) from None
        if loop is not self._loop:
            if self._loop is not None and (self._queue.in_flight or len(self._queue)):
                raise EventLoopError(
                    "the manager has swaps queued or in flight on another event loop; "
                    "use one manager per loop"
                )
            self._loop = loop  # rebind: nothing pending on the old loop
        return loop

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ClosedError("the manager is closed")

    def _enqueue(self, part: Part) -> None:
        if not self._scheduler.enqueue(part):  # nothing to copy: resolve now, no batch
            part.future.set_result(part.result)
            return
        if self._flush_on_tick and not self._tick_scheduled:
            self._tick_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush_tick)

    def _flush_tick(self) -> None:
        self._tick_scheduled = False
        if not self._closed:
            assert self._loop is not None
            self._flusher.flush(self._loop)

    # ------------------------------------------------------------------ keyed API

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that are READY in the CPU tier; touches them in
        the policy (the first key becomes the most recently used).

        Raises:
            InvalidKeyError: ``keys`` is not a sequence of bytes.
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        return self._books.lookup(keys, touch=True)

    def peek(self, keys: Sequence[bytes]) -> int:
        """Like ``lookup`` (the ready-prefix length) but touches nothing: for a router or an
        admission check that must not change the eviction order.

        Raises:
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        return self._books.lookup(keys, touch=False)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark READY keys as used (the first key becomes the most recent); keys not READY in
        the CPU tier are ignored.

        Raises:
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        self._books.touch(keys)

    def invalidate(self, keys: Sequence[bytes]) -> int:
        """Drop READY keys (and free their CPU blocks); unknown keys are ignored.

        Returns:
            Keys dropped. Each drop is a ``removed`` KV event.

        Raises:
            BlockStateError: a key has a store or loads in flight; nothing is dropped then
                (retry after those futures resolve).
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        dropped = self._books.invalidate(keys)
        self._room.wake()
        return dropped

    def clear(self) -> int:
        """Drop every READY key without loads in flight. Keys with a store or loads in flight
        stay (they are dropped by a later ``clear``). Returns the keys dropped.

        Raises:
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        dropped = self._books.clear()
        self._room.wake()
        return dropped

    def swap_out(
        self,
        gpu_block_ids: Sequence[int],
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        *,
        token_ids: Any = None,
        hint: Any = None,
    ) -> asyncio.Future[SwapResult]:
        """Queue a store of GPU blocks into the CPU tier under ``keys`` (``keys[i]`` names
        ``gpu_block_ids[i]``). ``parents[i]`` is the key ``keys[i]`` extends (``None``: a root);
        by default ``keys[i]`` extends ``keys[i - 1]``. The policy uses the chains to evict the
        leaves of a prefix before its root.

        Keys already in the CPU tier (any state) are skipped, and so are keys not admitted yet
        (``store_threshold``). The others get CPU blocks (free ones first, then by evicting
        READY blocks without loads in flight, never a key of this call) and are PENDING until
        the copy completes, READY after. The GPU blocks must not be overwritten before the
        returned future resolves.

        Returns:
            A future resolving to ``SwapResult`` (``cpu_block_ids``: the blocks written), or
            failing with ``TransferError`` (the PENDING keys are then dropped, blocks freed).

        Raises:
            InvalidBlockError: bad ids, or (owned pool) ids no request holds.
            InvalidKeyError: bad keys, different counts, or parents whose chain comes back to
                a new key (a key cycle, within the call or through stored keys).
            InvalidArgumentError: bad ``token_ids``.
            PoolExhaustedError: no room even after eviction; nothing changed (with
                ``backpressure="wait"`` the future waits for room instead, holding its GPU
                blocks like a queued store; cancelling it drops the store).
            ClosedError, EventLoopError: closed, or no running loop.

        ``hint``: a ``kvmgr.policy.StoreHint`` for every key (or one per key, or ``None``),
        used by policies that take hints (``"online"``); bad hints raise
        ``InvalidArgumentError`` before any change.
        """
        return self._store(gpu_block_ids, keys, parents, token_ids, batched=False, hints=hint)

    def store_many(
        self,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        *,
        parents: Sequence[bytes | None] | None = None,
        token_ids: Any = None,
        hints: Any = None,
    ) -> asyncio.Future[StoreResult]:
        """Queue one store of many requests' blocks: ONE future, array results.

        Args:
            gpu_block_ids: int ``[n]`` (numpy array or list): distinct GPU blocks to store.
            keys: ``n`` ``bytes`` keys; ``keys[i]`` names ``gpu_block_ids[i]``. A key repeated
                in the call (two requests that filled the same prefix block in one step) is
                stored once, from its first occurrence; the others count as present.
            parents: ``n`` entries: the key ``keys[i]`` extends, or ``None`` for a root.
                Default: one chain (``keys[i]`` extends ``keys[i - 1]``).
            token_ids: optional int ``[n, block_size]``: the tokens of each block, for the
                ``stored`` KV event (as ``swap_out``).
            hints: ``None``, one ``kvmgr.policy.StoreHint`` for all keys, or ``n`` entries
                (``StoreHint`` or ``None``; the requests of a batch differ), for policies that
                take hints (``"online"``).

        Returns:
            A future resolving to ``StoreResult`` (which keys were stored, which were already
            present, the CPU blocks written), or failing with ``TransferError``.

        Raises:
            KVMgrError: as ``swap_out``.
        """
        return self._store(gpu_block_ids, keys, parents, token_ids, batched=True, hints=hints)

    def _store(
        self,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        parents: Any,
        token_ids: Any,
        *,
        batched: bool,
        hints: Any = None,
    ) -> asyncio.Future[Any]:
        """Queue a store (per call or batched), or hand it to backpressure."""
        loop = self._check_open()
        future: asyncio.Future[Any] = loop.create_future()
        try:
            part = self._books.prepare_store(
                gpu_block_ids,
                keys,
                parents,
                future,
                batched=batched,
                token_ids=token_ids,
                hints=hints,
            )
        except PoolExhaustedError as exc:
            return self._when_room(
                exc, gpu_block_ids, keys, parents, token_ids, batched=batched, hints=hints
            )
        self._enqueue(part)
        return future

    def _when_room(
        self,
        exc: PoolExhaustedError,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        parents: Any,
        token_ids: Any,
        *,
        batched: bool,
        hints: Any = None,
    ) -> asyncio.Future[Any]:
        """Backpressure: fail now, or register the store to wait for room (it holds its GPU
        blocks meanwhile, like a queued store; see ``backpressure``)."""
        counters = self._books.counters
        if self.config.backpressure != "wait" or exc.needed > self.config.num_cpu_blocks:
            counters.reject(exc.reason)
            raise exc
        loop = self._check_open()
        books = self._books
        # validated again (cheap, and it copies what the caller may reuse): the ids are held
        gpu = books.gpu_ids(gpu_block_ids, "store")
        keys = check_keys(keys, distinct=False)
        parents = None if parents is None else list(parents)
        tokens = None if token_ids is None or not keys else check_token_ids(token_ids, len(keys))

        def attempt(future: asyncio.Future[Any]) -> Part:
            return books.prepare_store(
                gpu,
                keys,
                parents,
                future,
                batched=batched,
                held=True,
                token_ids=tokens,
                hints=hints,
            )

        future = WaitingFuture(loop=loop)
        held = np.array(gpu, dtype=np.int64)
        self._room.wait(
            loop, WaitingStore(future, attempt, held, keys, exc), self.config.store_wait_s
        )
        return future

    def swap_in(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]
    ) -> asyncio.Future[SwapResult]:
        """Queue a load of READY keys into GPU blocks (``keys[i]`` into ``gpu_block_ids[i]``).

        The keys' CPU blocks are pinned (not evictable) until the copy ends. Compute must not
        read the GPU blocks before the future resolves (or before ``stream_wait_loads``).

        Returns:
            A future resolving to ``SwapResult`` (``gpu_block_ids``: the blocks written), or
            failing with ``TransferError`` (the GPU blocks then hold undefined bytes).

        Raises:
            InvalidBlockError: bad ids, or (owned pool) ids no request holds.
            InvalidKeyError: bad keys, or different counts.
            UnknownKeyError: a key is not in the CPU tier. BlockStateError: a key is PENDING.
            ClosedError, EventLoopError: closed, or no running loop.
        """
        loop = self._check_open()
        future: asyncio.Future[SwapResult] = loop.create_future()
        self._enqueue(self._books.prepare_load(keys, gpu_block_ids, future, batched=False))
        return future

    def load_many(self, keys: Sequence[bytes], gpu_block_ids: Any) -> asyncio.Future[LoadResult]:
        """Queue one load of many requests' blocks: ONE future, array results.

        Args:
            keys: ``n`` READY keys (repeats allowed).
            gpu_block_ids: int ``[n]`` (numpy array or list), distinct GPU blocks to write.

        Raises:
            KVMgrError: as ``swap_in``.
        """
        loop = self._check_open()
        future: asyncio.Future[LoadResult] = loop.create_future()
        self._enqueue(self._books.prepare_load(keys, gpu_block_ids, future, batched=True))
        return future

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
        ``store.abort()`` (or closing the manager) fails the layers not saved yet.

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

    def _local_worker(self, what: str) -> TransferWorker:
        """Raises ConfigError: the copies run in other processes (``over_ranks``)."""
        if self._worker is None:
            raise ConfigError(f"{what} needs the in-process worker; not supported over ranks")
        return self._worker

    def _is_open(self) -> bool:
        return not (self._closed or self._closing)

    def _abort_layerwise(self) -> None:
        for store in self._layerwise_stores:
            store.abort()
        self._layerwise_stores = []

    # ------------------------------------------------------------------ lower tiers

    async def fetch(self, keys: Sequence[bytes]) -> int:
        """Stage the lower tiers' blocks of ``keys`` into the CPU tier (after its ready prefix,
        tier by tier: one batched read per tier, every blob verified) and return the new
        ready-prefix length; then ``swap_in``/``load_many`` the prefix as usual. A miss, a
        corrupt value or a failing tier ends the prefix there (recompute the rest); it never
        raises for a tier failure. Without lower tiers: ``lookup`` without the touch.

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
        """
        self._check_open()
        if self._tiers is not None:
            self._tiers.write_evicted(self._books.take_evicted(), asyncio.get_running_loop())
            await self._tiers.drain(timeout_s)

    def tier_statistics(self) -> list[tuple[Any, Any]]:
        """Per lower tier: ``(BridgeStatistics, TierStatistics)`` (totals)."""
        if self._tiers is None:
            return []
        return [(b.statistics(), b.backend.statistics()) for b in self._tiers.bridges]

    # ------------------------------------------------------------------ request-level API

    def allocate(self, req_id: Hashable, num_blocks: int) -> list[int]:
        """Allocate GPU blocks from the owned pool and append them to the request's table
        (created on first use).

        Raises:
            ConfigError: the manager does not own GPU blocks (``manage_gpu_blocks=False``).
            BlockStateError: the request is swapped out or moving.
            InvalidArgumentError: ``num_blocks`` is not an int >= 0, or a bad request id.
            PoolExhaustedError: too few free GPU blocks (reason ``"gpu_full"``); nothing changed.
        """
        self._check_not_closed()
        try:
            return self._books.requests.allocate(req_id, num_blocks)
        except PoolExhaustedError as exc:
            self._books.counters.reject(exc.reason)
            raise

    def append_blocks(self, req_id: Hashable, gpu_block_ids: Sequence[int]) -> None:
        """Append caller-owned GPU blocks to the request's table (created on first use).

        Raises:
            ConfigError: the manager owns the GPU blocks (use ``allocate``).
            InvalidBlockError: bad ids, or ids already in the table.
            BlockStateError: the request is swapped out or moving.
        """
        self._check_not_closed()
        self._books.requests.append(req_id, gpu_block_ids)

    def block_table(self, req_id: Hashable) -> list[tuple[Tier, int]]:
        """The request's blocks as ``[(tier, block_id), ...]`` in logical order.

        Raises:
            UnknownRequestError: no table for ``req_id``.
            InvalidArgumentError: ``req_id`` is not hashable.
        """
        return self._books.requests.lookup(req_id).entries()

    def is_moving(self, req_id: Hashable) -> bool:
        """Whether a preempt or resume of the request is queued or in flight.

        Raises:
            UnknownRequestError, InvalidArgumentError: as ``block_table``.
        """
        return self._books.requests.lookup(req_id).moving

    def preempt(self, req_id: Hashable) -> asyncio.Future[SwapResult]:
        """Queue a swap-out of all the request's GPU blocks into CPU blocks (not keyed, not
        evictable); once the copy completed the table points at the CPU blocks and the GPU
        blocks go back to the owned pool (or to the caller).

        Returns:
            A future resolving to ``SwapResult`` (``gpu_block_ids``: the GPU blocks given back).

        Raises:
            UnknownRequestError: no table. BlockStateError: swapped out already, or moving.
            PoolExhaustedError: no CPU room even after eviction; nothing changed.
        """
        loop = self._check_open()
        future: asyncio.Future[SwapResult] = loop.create_future()
        try:
            part = self._books.requests.prepare_preempt(req_id, future)
        except PoolExhaustedError as exc:
            self._books.counters.reject(exc.reason)
            raise
        self._enqueue(part)
        return future

    def resume(
        self, req_id: Hashable, gpu_block_ids: Sequence[int] | None = None
    ) -> asyncio.Future[SwapResult]:
        """Queue a swap-in of a preempted request into GPU blocks (allocated from the owned pool,
        or ``gpu_block_ids`` supplied by the caller); once complete, the table points at the GPU
        blocks and the CPU blocks are freed.

        Returns:
            A future resolving to ``SwapResult`` (``gpu_block_ids``: the blocks written).

        Raises:
            UnknownRequestError, BlockStateError: no table, not swapped out, or moving.
            InvalidBlockError: wrong number or bad caller-supplied ids.
            PoolExhaustedError: too few free GPU blocks; nothing changed.
        """
        loop = self._check_open()
        future: asyncio.Future[SwapResult] = loop.create_future()
        try:
            part = self._books.requests.prepare_resume(req_id, gpu_block_ids, future)
        except PoolExhaustedError as exc:
            self._books.counters.reject(exc.reason)
            raise
        self._enqueue(part)
        return future

    def free(self, req_id: Hashable) -> None:
        """Drop the request's table and free its blocks (owned GPU blocks or CPU blocks). An
        owned GPU block that a queued or in-flight copy still uses goes back when it ends.

        Raises:
            UnknownRequestError: no table. BlockStateError: a preempt or resume is in flight.
        """
        self._check_not_closed()
        self._books.requests.free(req_id)
        self._room.wake()

    # ------------------------------------------------------------------ step

    async def step(self, ctx: StepContext | None = None) -> StepReport:
        """Run the hooks in order on the compute stream, then submit everything queued since the
        last step as one plan per direction (more only when a hazard forces ordered batches).

        Args:
            ctx: what the scheduler knows about the step; ``None`` = an empty context. When
                ``ctx.stream`` is set, the batches are submitted with it as the current stream,
                so stores wait for the work queued on it so far (docs/transfer.md, rules 3-4).

        Returns:
            The step report: batches submitted, hooks, batches completed since the last step,
            host seconds spent here.

        Raises:
            ClosedError: the manager is closed.
            InvalidArgumentError: ``ctx`` is not a StepContext, or a hook returned no HookReport.
            Exception: whatever a hook raises (the queue is left untouched then).
        """
        self._check_open()
        if ctx is not None and not isinstance(ctx, StepContext):
            raise InvalidArgumentError(f"expected a StepContext or None, got {type(ctx).__name__}")
        start = time.perf_counter()
        step = self._step + 1
        hooks = self._hooks
        hook_reports: tuple[Any, ...] = ()
        if hooks:  # without hooks no context is needed
            if ctx is None:
                ctx = StepContext(step=step)
            hook_reports = tuple(hook(ctx) for hook in hooks)
            self._flusher.check_hook_reports(hooks, hook_reports)
        self._step = step
        if self._books.cpu.grow():  # pieces of the CPU tier pinned since: stores may retry,
            self._room.wake()  # and those that find room are submitted by this very step
        if ctx is not None and ctx.stream is not None:  # fence the copies on the compute stream
            with torch.cuda.stream(ctx.stream):
                d2h, h2d = self._flush()
        else:
            d2h, h2d = self._flush()
        completed = self._flusher.take_completed()
        self._books.counters.steps += 1
        report = StepReport(
            step=step if ctx is None or ctx.step is None else ctx.step,
            d2h=d2h,
            h2d=h2d,
            hooks=hook_reports,
            completed=completed,
            host_s=time.perf_counter() - start,
        )
        await asyncio.sleep(0)
        return report

    def _flush(self) -> tuple[Any, Any]:
        """Flush the queue; once more if a lane failed at submit freed room for waiting
        stores during this flush (they were queued behind it and would wait a whole step)."""
        room = self._room
        room.num_requeued = 0
        loop = self._loop
        assert loop is not None
        d2h, h2d = self._flusher.flush(loop)
        if room.num_requeued and len(self._queue):
            room.num_requeued = 0
            more_d2h, more_h2d = self._flusher.flush(loop)
            d2h, h2d = _sum_reports(d2h, more_d2h), _sum_reports(h2d, more_h2d)
        return d2h, h2d

    # ------------------------------------------------------------------ waiting

    async def wait(self, future: asyncio.Future[Any], timeout_s: float | None = None) -> Any:
        """Await a swap's future with a deadline.

        On timeout the copy is NOT cancelled: its blocks stay fenced (PENDING keys, pinned
        readers, a moving block table) until the copy truly ends and its bookkeeping runs.
        Cancelling the awaiting task likewise leaves the copy and the bookkeeping intact.

        Raises:
            InvalidArgumentError: ``future`` is not an asyncio future, or a bad ``timeout_s``.
            TransferTimeoutError: ``timeout_s`` seconds passed first (counted in
                ``ManagerStatistics.await_timeouts``).
            TransferError: whatever the swap raises (``TransferError``, ``ClosedError``, ...).
        """
        if not asyncio.isfuture(future):
            raise InvalidArgumentError(
                f"expected the future of a swap, got {type(future).__name__}: {future!r}"
            )
        if timeout_s is not None and not (
            isinstance(timeout_s, (int, float))
            and not isinstance(timeout_s, bool)
            and 0 <= timeout_s < float("inf")
        ):
            raise InvalidArgumentError(
                f"expected timeout_s >= 0 seconds or None, got {timeout_s!r}"
            )
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            self._books.counters.await_timeouts += 1
            raise TransferTimeoutError(
                f"swap not complete after {timeout_s} s; its blocks stay fenced until it ends"
            ) from None

    # ------------------------------------------------------------------ observability

    def statistics(self) -> ManagerStatistics:
        """A snapshot of totals and gauges (see ``ManagerStatistics``)."""
        books = self._books
        c, cpu = books.counters, books.cpu
        gpu_pool = books.gpu.pool
        cpu_pool = self.cpu_pool
        memory = None if cpu_pool is None else cpu_pool.memory
        return ManagerStatistics(
            **{name: getattr(c, name) for name in Counters.TOTALS},
            rejected=dict(c.rejected),
            events_dropped=books.events.num_dropped,
            batch_blocks=c.batch_blocks.freeze(),
            completion_s=c.completion_s.freeze(),
            batches_in_flight=len(self._queue.in_flight),
            queued_swaps=len(self._queue),
            stores_waiting=len(self._room),
            cpu_blocks_used=cpu.pool.num_allocated,
            cpu_blocks_total=cpu.num_blocks,
            cpu_blocks_ready=cpu.num_blocks if cpu_pool is None else cpu_pool.num_blocks_ready,
            cpu_pinning=None if memory is None else memory.statistics(),
            cpu_keys_pending=cpu.num_pending,
            cpu_keys_ready=len(cpu.index) - cpu.num_pending,
            cpu_keys_loading=cpu.num_loading,
            gpu_blocks_free=None if gpu_pool is None else gpu_pool.num_free,
            policy=cpu.policy.name,
            engine=f"ranks x{self._transport.num_ranks}"
            if self._worker is None
            else self.engine.name,
        )

    def snapshot(self) -> ManagerSnapshot:
        """Every block, key, table and queued or in-flight swap, as frozen values (for tests
        and ``kvmgr.testing.check_invariants``; costs O(blocks), not for the hot path)."""
        promoting = () if self._tiers is None else tuple(self._tiers.promoting)
        return take_snapshot(
            self._books,
            self._queue,
            promoting,
            self._room.stores,
            self._transport.engine_batches,
        )

    def take_events(self) -> list[KVEvent]:
        """Remove and return the KV events recorded since the last call, oldest first: a
        ``removed`` event of the keys a store evicted comes before that store's ``stored``."""
        return self._books.events.take()

    def events(self) -> AsyncIterator[KVEvent]:
        """An async iterator over KV events as they happen (``async for ev in mgr.events()``);
        it drains the same stream as ``take_events`` and ends when the manager closes."""
        return self._books.events.iterate()

    def stream_wait_loads(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait on the device for every load
        in flight, without blocking the host (docs/transfer.md, rule 4). No-op on the host
        engine."""
        for batch in self._queue.in_flight.values():
            if batch.direction is Direction.H2D:
                self._transport.stream_wait(batch.seq, stream)


def _sum_reports(a: Any, b: Any) -> Any:
    """Two flushes' ``DirectionReport`` of one direction, summed (an empty one is the unit)."""
    if not b.batches:
        return a
    if not a.batches:
        return b
    return a + b
