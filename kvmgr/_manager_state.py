"""Bookkeeping half of the manager: pools, prefix index, policy, block tables, counters.

Private; ``OffloadManager`` (manager.py) adds the event loop, the queue and the engine. Every
public method here validates first and mutates only after every check has passed.
"""

from __future__ import annotations

import abc
import asyncio
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr._queue import Op
from kvmgr.config import ManagerConfig
from kvmgr.errors import (
    BlockStateError,
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidKeyError,
    PoolExhaustedError,
    UnknownRequestError,
)
from kvmgr.policy import make_policy
from kvmgr.pool.allocator import BlockAllocator, _as_int_list
from kvmgr.pool.block_table import BlockTable, Tier
from kvmgr.pool.host_pool import HostKVPool
from kvmgr.pool.layout import KVLayout
from kvmgr.pool.prefix_index import BlockState, PrefixIndex
from kvmgr.reports import ManagerStatistics, SwapResult
from kvmgr.transfer.engine import BatchResult
from kvmgr.transfer.plan import Direction

__all__: list[str] = []


class ManagerState(abc.ABC):
    """Pools, index, policy, block tables and counters; see ``OffloadManager``."""

    def __init__(
        self,
        config: ManagerConfig,
        gpu_layout: KVLayout,
        allocate_host: Callable[[int], torch.Tensor],
    ) -> None:
        self.config = config
        self.gpu_layout = gpu_layout
        self.cpu_pool = HostKVPool(
            gpu_layout.page_bytes.tolist(), config.num_cpu_blocks, allocate_host
        )
        self.cpu_blocks = BlockAllocator(config.num_cpu_blocks, name="cpu")
        self.gpu_blocks: BlockAllocator | None = (
            BlockAllocator(gpu_layout.num_blocks, name="gpu") if config.manage_gpu_blocks else None
        )
        self.index = PrefixIndex()
        self.policy = make_policy(
            config.policy, config.num_cpu_blocks, **dict(config.policy_options)
        )
        self._tables: dict[Hashable, BlockTable] = {}
        self._counts: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._device_s = {Direction.D2H: 0.0, Direction.H2D: 0.0}
        self._block_bytes = gpu_layout.block_bytes
        self._closed = False
        #: GPU block -> queued or in-flight copies that read or write it.
        self._gpu_busy: Counter[int] = Counter()
        #: owned GPU blocks freed while busy: returned to the pool when their copies end.
        self._gpu_free_deferred: set[int] = set()

    @abc.abstractmethod
    def _new_future(self) -> asyncio.Future[Any]: ...

    @abc.abstractmethod
    def _enqueue(self, op: Op) -> None: ...

    # ------------------------------------------------------------------ validation

    def _gpu_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = _as_int_list(block_ids, "gpu")
        n = self.gpu_layout.num_blocks
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(b for b in ids if not 0 <= b < n)
            raise InvalidBlockError(f"gpu block id {bad} out of range [0, {n})")
        if len(set(ids)) != len(ids):
            raise InvalidBlockError(f"duplicate gpu block ids in {ids}")
        return ids

    @staticmethod
    def _keys(keys: Sequence[bytes], *, distinct: bool) -> list[bytes]:
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise InvalidKeyError(f"expected a sequence of bytes keys, got {type(keys).__name__}")
        for key in keys:
            if not isinstance(key, bytes):
                raise InvalidKeyError(f"expected bytes keys, got {type(key).__name__}: {key!r}")
        if distinct and len(set(keys)) != len(keys):
            raise InvalidKeyError("keys of one store must be distinct")
        return list(keys)

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ClosedError("the manager is closed")

    @staticmethod
    def _check_req_id(req_id: object) -> None:
        try:
            hash(req_id)
        except TypeError:
            raise InvalidArgumentError(
                f"expected a hashable request id, got {type(req_id).__name__}"
            ) from None

    def _table(self, req_id: Hashable) -> BlockTable:
        self._check_not_closed()
        self._check_req_id(req_id)
        table = self._tables.get(req_id)
        if table is None:
            raise UnknownRequestError(f"request {req_id!r} has no block table")
        if table.moving:
            raise BlockStateError(f"request {req_id!r} has a preempt or resume in flight")
        return table

    # ------------------------------------------------------------------ CPU room

    def _make_room(self, n: int, protected: Sequence[bytes]) -> list[int]:
        """Allocate ``n`` CPU blocks, evicting READY unread keys if needed; all or nothing.

        Raises:
            PoolExhaustedError: (reason ``"cpu_full"``) not enough free + evictable blocks.
        """
        shortfall = n - self.cpu_blocks.num_free
        if shortfall > 0:
            victims = self.policy.evict(shortfall, self.index.is_evictable, frozenset(protected))
            if victims is None:
                raise PoolExhaustedError(
                    f"cpu tier: need {n} blocks, {self.cpu_blocks.num_free} free and too few "
                    "evictable (READY without loads in flight)",
                    needed=n,
                    available=self.cpu_blocks.num_free,
                    reason="cpu_full",
                )
            self.cpu_blocks.free([self.index.remove(key) for key in victims])
            self._counts["evictions"] += len(victims)
        return self.cpu_blocks.allocate(n)

    # ------------------------------------------------------------------ keyed API

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that are READY in the CPU tier; touches them in
        the policy (the first key becomes the most recently used).

        Raises:
            InvalidKeyError: ``keys`` is not a sequence of bytes.
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        keys = self._keys(keys, distinct=False)
        hits = self.index.lookup(keys)
        self.policy.touch(keys[:hits])
        counts = self._counts
        counts["lookups"] += 1
        counts["lookup_keys"] += len(keys)
        counts["lookup_hits"] += hits
        return hits

    def swap_out(
        self,
        gpu_block_ids: Sequence[int],
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
    ) -> asyncio.Future[Any]:
        """Queue a store of GPU blocks into the CPU tier under ``keys`` (``keys[i]`` names
        ``gpu_block_ids[i]``); ``parents[i]`` is the key ``keys[i]`` extends (default: all
        ``None``, parents unknown; the v2 manager's ``store_many`` defaults to one chain).

        Keys already in the CPU tier (any state) are skipped. The others get CPU blocks (free
        ones first, then by evicting READY blocks without loads in flight, never a key of this
        call) and are PENDING until the copy completes, READY after. The GPU blocks must not be
        overwritten before the returned future resolves.

        Returns:
            A future resolving to ``SwapResult`` (CPU block ids of the stored keys), or failing
            with ``TransferError`` (the PENDING keys are then dropped and their blocks freed).

        Raises:
            InvalidBlockError, InvalidKeyError: bad ids or keys, or different counts.
            PoolExhaustedError: no room even after eviction; nothing changed.
            ClosedError: the manager is closed.
        """
        gpu = self._gpu_ids(gpu_block_ids)
        keys = self._keys(keys, distinct=True)
        if len(keys) != len(gpu):
            raise InvalidKeyError(
                f"expected one key per gpu block, got {len(keys)} keys and {len(gpu)} blocks"
            )
        if parents is None:
            parents = [None] * len(keys)
        elif len(parents) != len(keys):
            raise InvalidKeyError(f"expected one parent per key, got {len(parents)}")
        future = self._new_future()
        fresh = [i for i, key in enumerate(keys) if key not in self.index]
        admit = getattr(self.policy, "admit", None)
        if admit is not None and fresh:  # admission control: declined keys are skipped
            accepted = admit([keys[i] for i in fresh], [parents[i] for i in fresh])
            fresh = [i for i, ok in zip(fresh, accepted) if ok]
        new_keys = [keys[i] for i in fresh]
        if len(fresh) < len(keys):
            self.policy.touch([key for key in keys if key in self.index])
        cpu = self._make_room(len(new_keys), keys)
        for key, block_id in zip(new_keys, cpu):
            self.index.add_pending(key, block_id)
        self.policy.insert(new_keys, [parents[i] for i in fresh])
        self._counts["stores_queued"] += len(new_keys)
        self._counts["stores_skipped"] += len(keys) - len(new_keys)
        result = SwapResult(
            num_blocks=len(new_keys),
            num_bytes=len(new_keys) * self._block_bytes,
            num_skipped=len(keys) - len(new_keys),
            block_ids=tuple(cpu),
        )

        def on_success() -> SwapResult:
            for key in new_keys:
                self.index.mark_ready(key)
            self._counts["stores_completed"] += len(new_keys)
            return result

        def on_failure(_: BaseException) -> None:
            for key in new_keys:  # only PENDING keys: none of them became READY
                self.index.remove(key)
            self.policy.remove(new_keys)
            self.cpu_blocks.free(cpu)
            self._counts["stores_failed"] += len(new_keys)

        src = gpu if len(fresh) == len(gpu) else [gpu[i] for i in fresh]
        return self._queue_op(Direction.D2H, src, cpu, future, on_success, on_failure)

    def swap_in(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> asyncio.Future[Any]:
        """Queue a load of READY keys into GPU blocks (``keys[i]`` into ``gpu_block_ids[i]``).

        The keys' CPU blocks are pinned (not evictable) until the copy ends. Compute must not
        read the GPU blocks before the future resolves (or before ``stream_wait_loads``).

        Returns:
            A future resolving to ``SwapResult`` (the GPU block ids), or failing with
            ``TransferError`` (the GPU blocks then hold undefined bytes).

        Raises:
            InvalidBlockError, InvalidKeyError: bad ids or keys, or different counts.
            UnknownKeyError: a key is not in the CPU tier.
            BlockStateError: a key is still PENDING.
            ClosedError: the manager is closed.
        """
        keys = self._keys(keys, distinct=False)
        gpu = self._gpu_ids(gpu_block_ids)
        if len(keys) != len(gpu):
            raise InvalidKeyError(
                f"expected one gpu block per key, got {len(gpu)} blocks and {len(keys)} keys"
            )
        for key in keys:
            if self.index.entry(key).state is not BlockState.READY:
                raise BlockStateError(
                    f"key {key.hex()[:16]}... is still pending; it cannot be loaded"
                )
        future = self._new_future()
        cpu = [self.index.add_reader(key) for key in keys]
        self.policy.touch(keys)
        self._counts["loads_queued"] += len(keys)
        result = SwapResult(
            num_blocks=len(keys),
            num_bytes=len(keys) * self._block_bytes,
            block_ids=tuple(gpu),
        )

        def on_success() -> SwapResult:
            for key in keys:
                self.index.remove_reader(key)
            self._counts["loads_completed"] += len(keys)
            return result

        def on_failure(_: BaseException) -> None:
            for key in keys:
                self.index.remove_reader(key)
            self._counts["loads_failed"] += len(keys)

        return self._queue_op(Direction.H2D, cpu, gpu, future, on_success, on_failure)

    def _queue_op(
        self,
        direction: Direction,
        src: list[int],
        dst: list[int],
        future: asyncio.Future[Any],
        on_success: Callable[[], Any],
        on_failure: Callable[[BaseException], None],
    ) -> asyncio.Future[Any]:
        if len(src) == 0:  # nothing to copy: resolve now, no batch
            future.set_result(on_success())
            return future
        gpu_ids = src if direction is Direction.D2H else dst
        busy = self._gpu_busy
        for block_id in gpu_ids:
            busy[block_id] += 1

        def succeeded() -> Any:
            try:
                return on_success()
            finally:
                self._release_gpu(gpu_ids)

        def failed(exc: BaseException) -> None:
            try:
                on_failure(exc)
            finally:
                self._release_gpu(gpu_ids)

        self._enqueue(Op(direction, src, dst, future, succeeded, failed))
        return future

    def _release_gpu(self, gpu_ids: list[int]) -> None:
        """A copy touching these GPU blocks ended: free those whose free was deferred."""
        busy, deferred, ready = self._gpu_busy, self._gpu_free_deferred, []
        for block_id in gpu_ids:
            left = busy[block_id] - 1
            if left:
                busy[block_id] = left
                continue
            del busy[block_id]
            if block_id in deferred:
                deferred.remove(block_id)
                ready.append(block_id)
        if ready and self.gpu_blocks is not None:
            self.gpu_blocks.free(ready)

    def _free_gpu(self, gpu_ids: list[int]) -> None:
        """Return owned GPU blocks; a block that a queued or in-flight copy still reads or
        writes goes back only when that copy ends (never handed out while the DMA runs)."""
        assert self.gpu_blocks is not None
        now = [b for b in gpu_ids if b not in self._gpu_busy]
        self._gpu_free_deferred.update(b for b in gpu_ids if b in self._gpu_busy)
        self.gpu_blocks.free(now)

    # ------------------------------------------------------------------ request-level API

    def allocate(self, req_id: Hashable, num_blocks: int) -> list[int]:
        """Allocate GPU blocks from the owned pool and append them to the request's table
        (created on first use).

        Raises:
            ConfigError: the manager does not own GPU blocks (``manage_gpu_blocks=False``).
            BlockStateError: the request is swapped out, moving, or holds caller-owned blocks.
            PoolExhaustedError: too few free GPU blocks; nothing changed.
        """
        if self.gpu_blocks is None:
            raise ConfigError("allocate() needs manage_gpu_blocks=True; use append_blocks()")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise InvalidArgumentError(f"expected an int number of blocks, got {num_blocks!r}")
        table = self._resident_table(req_id, owned=True)
        ids = self.gpu_blocks.allocate(num_blocks)
        table.block_ids.extend(ids)
        table.gpu_owned = True
        self._tables[req_id] = table
        return ids

    def append_blocks(self, req_id: Hashable, gpu_block_ids: Sequence[int]) -> None:
        """Append caller-owned GPU blocks to the request's table (created on first use).

        Raises:
            ConfigError: the manager owns the GPU blocks (use ``allocate``).
            InvalidBlockError: bad ids, or ids already in the table.
            BlockStateError: the request is swapped out or moving.
        """
        if self.gpu_blocks is not None:
            raise ConfigError("append_blocks() needs manage_gpu_blocks=False; use allocate()")
        new_ids = _as_int_list(gpu_block_ids, "gpu")
        table = self._resident_table(req_id, owned=False)
        ids = self._gpu_ids(list(table.block_ids) + new_ids)[len(table.block_ids) :]
        table.block_ids.extend(ids)
        table.gpu_owned = False
        self._tables[req_id] = table

    def _resident_table(self, req_id: Hashable, *, owned: bool) -> BlockTable:
        self._check_not_closed()
        self._check_req_id(req_id)
        table = self._tables.get(req_id) or BlockTable(req_id)
        if table.moving or table.tier is not Tier.GPU:
            raise BlockStateError(f"request {req_id!r} is swapped out or moving")
        if table.gpu_owned is not None and table.gpu_owned is not owned:
            raise BlockStateError(f"request {req_id!r} mixes owned and caller-owned GPU blocks")
        return table

    def block_table(self, req_id: Hashable) -> list[tuple[Tier, int]]:
        """The request's blocks as ``[(tier, block_id), ...]`` in logical order.

        Raises:
            UnknownRequestError: no table for ``req_id``.
            InvalidArgumentError: ``req_id`` is not hashable.
        """
        self._check_req_id(req_id)
        table = self._tables.get(req_id)
        if table is None:
            raise UnknownRequestError(f"request {req_id!r} has no block table")
        return table.entries()

    def preempt(self, req_id: Hashable) -> asyncio.Future[Any]:
        """Queue a swap-out of all the request's GPU blocks into CPU blocks (not keyed, not
        evictable); once the copy completed the table points at the CPU blocks and the GPU blocks
        are freed (owned pool) or handed back.

        Returns:
            A future resolving to ``SwapResult`` whose ``block_ids`` are the freed GPU ids.

        Raises:
            UnknownRequestError: no table. BlockStateError: swapped out already, or moving.
            PoolExhaustedError: no CPU room even after eviction; nothing changed.
        """
        table = self._table(req_id)
        if table.tier is not Tier.GPU:
            raise BlockStateError(f"request {req_id!r} is already swapped out")
        gpu = list(table.block_ids)
        future = self._new_future()
        cpu = self._make_room(len(gpu), ())
        table.moving = True
        self._counts["stores_queued"] += len(gpu)

        def on_success() -> SwapResult:
            table.tier, table.block_ids, table.moving = Tier.CPU, list(cpu), False
            if table.gpu_owned and self.gpu_blocks is not None:
                self._free_gpu(gpu)
            self._counts["stores_completed"] += len(gpu)
            return SwapResult(
                num_blocks=len(gpu),
                num_bytes=len(gpu) * self._block_bytes,
                block_ids=tuple(gpu),
            )

        def on_failure(_: BaseException) -> None:
            self.cpu_blocks.free(cpu)
            table.moving = False
            self._counts["stores_failed"] += len(gpu)

        return self._queue_op(
            Direction.D2H,
            gpu,
            cpu,
            future,
            on_success,
            on_failure,
        )

    def resume(
        self, req_id: Hashable, gpu_block_ids: Sequence[int] | None = None
    ) -> asyncio.Future[Any]:
        """Queue a swap-in of a preempted request into GPU blocks (allocated from the owned pool,
        or ``gpu_block_ids`` supplied by the caller); once complete, the table points at the GPU
        blocks and the CPU blocks are freed.

        Returns:
            A future resolving to ``SwapResult`` whose ``block_ids`` are the GPU ids.

        Raises:
            UnknownRequestError, BlockStateError: no table, not swapped out, or moving.
            InvalidBlockError: wrong number or bad caller-supplied ids.
            PoolExhaustedError: too few free GPU blocks; nothing changed.
        """
        table = self._table(req_id)
        if table.tier is not Tier.CPU:
            raise BlockStateError(f"request {req_id!r} is not swapped out")
        cpu = list(table.block_ids)
        if table.gpu_owned:
            if gpu_block_ids is not None:
                raise InvalidBlockError("this request's GPU blocks come from the owned pool")
            assert self.gpu_blocks is not None
            future = self._new_future()
            gpu = self.gpu_blocks.allocate(len(cpu))
        else:
            if gpu_block_ids is None or len(_as_int_list(gpu_block_ids, "gpu")) != len(cpu):
                raise InvalidBlockError(f"expected {len(cpu)} caller-owned gpu block ids")
            gpu = self._gpu_ids(gpu_block_ids)
            future = self._new_future()
        table.moving = True
        self._counts["loads_queued"] += len(cpu)

        def on_success() -> SwapResult:
            self.cpu_blocks.free(cpu)
            table.tier, table.block_ids, table.moving = Tier.GPU, list(gpu), False
            self._counts["loads_completed"] += len(cpu)
            return SwapResult(
                num_blocks=len(cpu),
                num_bytes=len(cpu) * self._block_bytes,
                block_ids=tuple(gpu),
            )

        def on_failure(_: BaseException) -> None:
            if table.gpu_owned and self.gpu_blocks is not None:
                self._free_gpu(gpu)
            table.moving = False
            self._counts["loads_failed"] += len(cpu)

        return self._queue_op(
            Direction.H2D,
            cpu,
            gpu,
            future,
            on_success,
            on_failure,
        )

    def free(self, req_id: Hashable) -> None:
        """Drop the request's table and free its blocks (owned GPU blocks or CPU blocks).

        Raises:
            UnknownRequestError: no table. BlockStateError: a preempt or resume is in flight.
        """
        table = self._table(req_id)
        if table.tier is Tier.CPU:
            self.cpu_blocks.free(table.block_ids)
        elif table.gpu_owned and self.gpu_blocks is not None:
            self._free_gpu(table.block_ids)
        del self._tables[req_id]

    # ------------------------------------------------------------------ counters

    def _count_batch(self, result: BatchResult) -> None:
        self._counts["bytes_" + result.direction.value] += result.num_bytes
        self._device_s[result.direction] += result.device_s or 0.0

    def _count_step(self) -> None:
        self._counts["steps"] += 1

    def _snapshot(self, **extra: int) -> ManagerStatistics:
        names = {f.name for f in attrs.fields(ManagerStatistics)}
        return ManagerStatistics(
            **{k: v for k, v in self._counts.items() if k in names},
            rejected=dict(self._rejected),
            device_s_d2h=self._device_s[Direction.D2H],
            device_s_h2d=self._device_s[Direction.H2D],
            cpu_blocks_used=self.cpu_blocks.num_allocated,
            cpu_blocks_total=self.cpu_blocks.num_blocks,
            cpu_keys_pending=self.index.num_pending,
            cpu_keys_ready=len(self.index) - self.index.num_pending,
            gpu_blocks_free=None if self.gpu_blocks is None else self.gpu_blocks.num_free,
            policy=self.policy.name,
            engine=self.engine.name,
            **extra,
        )
