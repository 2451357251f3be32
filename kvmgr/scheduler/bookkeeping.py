"""The Bookkeeper: every state a block, key or request can be in; no tensors, no engine, no torch.

Private to ``kvmgr.scheduler``; ``Scheduler`` holds one.

Two phases (like vLLM's ``prepare_store`` / ``complete_store``): ``prepare_store``,
``prepare_load``, ``requests.prepare_preempt`` and ``requests.prepare_resume`` validate, then
reserve and mark what the copy needs, and return a ``Part`` (a plain record with the block ids,
the keys and the result the caller gets on success). ``complete(lane, ok)`` applies the outcome
of a whole lane of parts, with array operations over all its blocks, and returns what landed as
data (``Landed``). Between the two:

- a store's new keys are ``PENDING`` on their CPU blocks (not readable, not evictable);
- a load's CPU blocks have one more reader each (not evictable);
- a preempt's CPU blocks are ``PREEMPTING``, a resume's ``RESUMING``, their table is moving;
- every GPU block named has one more busy count (an owned block freed meanwhile is
  ``DRAINING``, handed out again only when its last copy ended).

Promotes from lower tiers go through here too (``prepare_promote`` / ``complete_promote``), so
no other object changes the CPU tier's states. Every ``prepare_*`` raises a typed error before
changing anything.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from kvmgr.config import ManagerConfig
from kvmgr.errors import BlockStateError, InvalidKeyError, UnknownKeyError
from kvmgr.reports import LoadResult, SwapResult
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.cpu_tier import CpuState, CpuTier
from kvmgr.scheduler.deferred import DeferredStores
from kvmgr.scheduler.events import EventStream
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.scheduler.jobs import KVGeometry
from kvmgr.scheduler.keys import check_keys
from kvmgr.scheduler.landing import Landed, complete_lane
from kvmgr.scheduler.queue import Kind, Lane, Part
from kvmgr.scheduler.requests import RequestTables
from kvmgr.scheduler.settle import settle
from kvmgr.scheduler.store import Stores

__all__ = ["Bookkeeper", "Landed", "check_keys"]

_READY = int(CpuState.READY)
_new = tuple.__new__  # a SwapResult from its fields, as ``fanout`` makes them


class Bookkeeper:
    """CPU tier, GPU blocks, request tables, counters and the KV event stream.

    Args:
        config: the manager's settings.
        geometry: the KV cache's blocks and page bytes (one rank's).
        blocks_ready: how many leading CPU blocks the CPU tier's memory lets the allocator
            hand out now (a region still being pinned); ``None``: all of them.
        keep_evicted: record evictions as data (``take_evicted``) for lower tiers.
    """

    def __init__(
        self,
        config: ManagerConfig,
        geometry: KVGeometry,
        blocks_ready: Callable[[], int] | None = None,
        *,
        keep_evicted: bool = False,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.events = EventStream(config.max_events)
        self.counters = Counters()
        self.cpu = CpuTier(
            config.num_cpu_blocks,
            config.policy,
            self.events.removed,
            config.policy_options,
            self.counters,
            blocks_ready=blocks_ready,
            keep_evicted=keep_evicted,
        )
        self.gpu = GpuBlocks(geometry.num_gpu_blocks, owned=config.manage_gpu_blocks)
        self.requests = RequestTables(self.cpu, self.gpu, self.block_bytes, self.counters)
        self.stores = Stores(self.cpu, self.gpu, self.counters, config, self.block_bytes)
        #: ``prepare_store(gpu_block_ids, keys, parents, future, *, batched, held=False,
        #: token_ids=None, hints=None) -> Part``: a keyed store's ``Part`` (the new keys PENDING
        #: on reserved CPU blocks, the GPU blocks busy); raises as ``Stores.prepare`` (it is that
        #: bound method: no frame of its own per store) before changing anything
        self.prepare_store = self.stores.prepare
        #: per-call stores recorded, prepared together by ``settle_deferred``
        self.deferred = DeferredStores(self.cpu, self.gpu, enabled=self.stores.plain_admission)

    def settle_deferred(self) -> list[Part]:
        """Prepare the per-call stores recorded since the last call (``deferred``): one
        ``Part`` for all of them, to queue before anything else (empty list: none)."""
        return settle(self.deferred, self.stores)

    def gpu_ids(self, block_ids: object, what: str) -> list[int] | np.ndarray:
        """Validated GPU ids (``GpuBlocks.checked_ids``).

        Raises:
            InvalidBlockError: not ints, out of range, repeated, or (owned pool) not held.
        """
        return self.gpu.checked_ids(block_ids, what)

    def take_evicted(self) -> list[tuple[list[bytes], np.ndarray]]:
        """(keys, CPU ids) the policy evicted since the last call (with ``keep_evicted``)."""
        return self.cpu.take_evicted()

    # ------------------------------------------------------------------ keyed queries

    def lookup(self, keys: Sequence[bytes], *, touch: bool) -> int:
        """Ready-prefix length; with ``touch`` the hits are touched in the policy.

        Raises:
            InvalidKeyError: not a sequence of bytes.
        """
        keys = check_keys(keys, distinct=False)
        hits = self.cpu.ready_prefix(keys)
        counters = self.counters
        if touch:
            if hits:
                self.cpu.policy.touch(keys[:hits])
            counters.lookups += 1
            counters.lookup_keys += len(keys)
            counters.lookup_hits += hits
        else:
            counters.peeks += 1
        return hits

    def held(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` the CPU tier holds, PENDING or READY (touches nothing).

        Raises:
            InvalidKeyError: not a sequence of bytes.
        """
        index = self.cpu.index
        return sum(key in index for key in check_keys(keys, distinct=False))

    def touch(self, keys: Sequence[bytes]) -> None:
        """Touch the READY keys among ``keys`` (first = most recent); others are ignored."""
        keys = check_keys(keys, distinct=False)
        index, state = self.cpu.index, self.cpu.state
        ready = [k for k in keys if (b := index.get(k)) is not None and state[b] == _READY]
        if ready:
            self.cpu.policy.touch(ready)

    def invalidate(self, keys: Sequence[bytes]) -> int:
        """Drop READY keys without readers; unknown keys are ignored. Returns keys dropped.

        Raises:
            BlockStateError: a key is PENDING or has loads in flight; nothing dropped then.
        """
        keys = check_keys(keys, distinct=False)
        cpu = self.cpu
        found = list(dict.fromkeys(k for k in keys if k in cpu.index))
        for key in found:
            if not cpu.can_evict(key):
                raise BlockStateError(
                    f"key {key.hex()[:16]}... has a store or loads in flight; invalidate it "
                    "after they complete"
                )
        if found:
            cpu.drop(found)
            self.counters.invalidated += len(found)
        return len(found)

    def clear(self) -> int:
        """Drop every READY key without readers; keys with copies in flight stay."""
        cpu = self.cpu
        keys = [k for k in cpu.index if cpu.can_evict(k)]
        if keys:
            cpu.drop(keys)
            self.counters.invalidated += len(keys)
        return len(keys)

    # ------------------------------------------------------------------ store and load

    def prepare_load(
        self, keys: object, gpu_block_ids: object, future: Any, *, batched: bool
    ) -> Part:
        """Pin the keys' CPU blocks (one reader each) for a load into GPU blocks.

        Raises:
            InvalidBlockError, InvalidKeyError: bad ids or keys, or different counts.
            UnknownKeyError: a key is not in the CPU tier.
            BlockStateError: a key is still PENDING.
        """
        keys = check_keys(keys, distinct=False)
        gpu = self.gpu.checked_ids(gpu_block_ids, "load")
        if len(keys) != len(gpu):
            raise InvalidKeyError(
                f"expected one gpu block per key, got {len(gpu)} blocks and {len(keys)} keys"
            )
        cpu = self.cpu
        blocks = list(map(cpu.index.get, keys))
        if None in blocks:
            key = keys[blocks.index(None)]
            raise UnknownKeyError(f"key {key.hex()[:16]}... is not in the CPU tier")
        cpu_list: list[int] = blocks  # type: ignore[assignment]
        small = isinstance(gpu, list)
        if small:  # a plain loop (a generator's frame costs more than a per-call load's key)
            state, ready = cpu.state, True
            for b in cpu_list:
                if state[b] != _READY:
                    ready = False
                    break
        else:
            cpu_arr = np.array(cpu_list, dtype=np.int64)
            ready = bool((cpu.state_np[cpu_arr] == _READY).all())
        if not ready:
            key = next(k for k, b in zip(keys, cpu_list) if cpu.state[b] != _READY)
            raise BlockStateError(f"key {key.hex()[:16]}... is still pending; it cannot be loaded")
        n, nbytes = len(keys), len(keys) * self.block_bytes
        cpu_ids: Any = cpu_list if small else cpu_arr
        cpu.add_readers(cpu_ids)
        touch_blocks = None if small else getattr(cpu.policy, "touch_blocks", None)
        if n and touch_blocks is not None:  # by block (``BlockLru``): the blocks found above,
            touch_blocks(keys, cpu_arr)  # not the keys looked up again
        elif n:
            cpu.policy.touch(keys)
        self.gpu.acquire(gpu)
        self.counters.loads_queued += n
        result: object
        if batched:
            gpu_arr = np.array(gpu, dtype=np.int64) if small else gpu
            result = LoadResult(
                gpu_block_ids=gpu_arr,
                cpu_block_ids=np.array(cpu_list, dtype=np.int64) if small else cpu_arr,
                num_bytes=nbytes,
            )
        else:
            gpu_ids = tuple(gpu) if small else tuple(gpu.tolist())  # (tuple.__new__: not the
            result = _new(SwapResult, (n, nbytes, 0, tuple(cpu_list), gpu_ids))  # Python one)
        return Part(Kind.LOAD, future, result, gpu, cpu_ids, keys)

    # ------------------------------------------------------------------ promotes (lower tiers)

    def prepare_promote(self, keys: list[bytes], protected: Collection[bytes]) -> np.ndarray:
        """CPU blocks for keys read from a lower tier (PENDING until ``complete_promote``),
        evicting unprotected READY blocks as needed; all or nothing.

        Raises:
            PoolExhaustedError: too few free and evictable blocks; nothing changed.
        """
        ids = self.cpu.make_room(len(keys), protected)
        self.cpu.add_pending(keys, ids, [None, *keys[:-1]])
        return ids

    def complete_promote(self, keys: list[bytes], ids: np.ndarray, hit: np.ndarray) -> int:
        """The read of promoted keys ended: verified hits READY (one ``stored`` event), the
        others dropped and their blocks freed. Returns the number of hits."""
        cpu = self.cpu
        ok = [k for k, h in zip(keys, hit.tolist()) if h]
        if ok:
            cpu.stores_landed(ids[hit])
            self.events.stored(ok)
        if not hit.all():
            cpu.stores_failed([k for k, h in zip(keys, hit.tolist()) if not h], ids[~hit])
        return len(ok)

    # ------------------------------------------------------------------ completion

    def complete(
        self, lane: Lane, gpu_ids: np.ndarray, cpu_ids: np.ndarray, ok: bool
    ) -> Landed | None:
        """Apply the outcome of a lane's copy (``ok``: it completed on every rank) to every part
        (``landing.complete_lane``: array operations over the lane's blocks, one step per
        request-level part; the caller resolves the futures after this returns).

        Returns:
            The keyed stores that became READY (``Landed``), or ``None`` (none, or a failure).
        """
        return complete_lane(self, lane, gpu_ids, cpu_ids, ok)
