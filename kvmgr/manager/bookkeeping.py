"""The Bookkeeper: every state a block, key or request can be in, with no asyncio and no engine.

Private to ``kvmgr.manager``; ``OffloadManager`` holds one.

Two phases (like vLLM's ``prepare_store`` / ``complete_store``): ``prepare_store``,
``prepare_load``, ``prepare_preempt`` and ``prepare_resume`` validate, then reserve and mark
what the copy needs, and return a ``Part`` (a plain record with the block ids, the keys and the
result the caller gets on success). ``complete(lane, ok)`` applies the outcome of a whole lane
of parts, with array operations over all its blocks. Between the two:

- a store's new keys are ``PENDING`` on their CPU blocks (not readable, not evictable);
- a load's CPU blocks have one more reader each (not evictable);
- a preempt's CPU blocks are ``PREEMPTING``, a resume's ``RESUMING``, their table is moving;
- every GPU block named has one more busy count (an owned block freed meanwhile is
  ``DRAINING``, handed out again only when its last copy ended).

Every ``prepare_*`` raises a typed error before changing anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import BlockStateError, InvalidKeyError, UnknownKeyError
from kvmgr.events.tokens import check_token_ids
from kvmgr.manager.counters import Counters
from kvmgr.manager.cpu_tier import CpuTier
from kvmgr.manager.events import EventStream
from kvmgr.manager.gpu_pool import GpuBlocks
from kvmgr.manager.queue import Kind, Lane, Part
from kvmgr.manager.requests import RequestTables
from kvmgr.pool.allocator import as_id_array
from kvmgr.pool.host_pool import HostKVPool, HostRegion, HostRegionLayout
from kvmgr.pool.layout import KVLayout
from kvmgr.reports import LoadResult, StoreResult, SwapResult
from kvmgr.transfer.plan import Direction

__all__ = ["Bookkeeper", "check_keys"]

#: Calls with at most this many blocks take the list path (no numpy per call).
SMALL = 8
_READY = 2


def check_keys(keys: object, *, distinct: bool) -> list[bytes]:
    """``keys`` as a list of bytes.

    Raises:
        InvalidKeyError: not a sequence of bytes, or repeated keys where ``distinct``.
    """
    if type(keys) is list:
        out = keys[:]  # the caller may reuse its list
    elif isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidKeyError(f"expected a sequence of bytes keys, got {type(keys).__name__}")
    else:
        out = list(keys)
    if len(out) > SMALL:
        is_bytes = set(map(type, out)) == {bytes}
    else:
        is_bytes = all(type(key) is bytes for key in out)
    if not is_bytes:
        key = next(k for k in out if type(k) is not bytes)
        raise InvalidKeyError(f"expected bytes keys, got {type(key).__name__}: {key!r}")
    if distinct and len(out) > 1 and len(set(out)) != len(out):
        raise InvalidKeyError("keys of one store must be distinct")
    return out


def _parents(keys: list[bytes], parents: object) -> list[bytes | None]:
    """One parent per key: ``parents`` as given, or one chain (``keys[i]`` extends
    ``keys[i-1]``, ``keys[0]`` is a root)."""
    if parents is None:
        return [None, *keys[:-1]]
    if isinstance(parents, (bytes, str)) or not isinstance(parents, Sequence):
        raise InvalidKeyError(f"expected a sequence of parent keys, got {type(parents).__name__}")
    out = list(parents)
    if len(out) != len(keys):
        raise InvalidKeyError(f"expected one parent per key, got {len(out)} for {len(keys)} keys")
    for key, parent in zip(keys, out):
        if parent is not None and type(parent) is not bytes:
            raise InvalidKeyError(f"expected bytes or None parents, got {parent!r}")
        if parent == key:
            raise InvalidKeyError(f"key {key.hex()[:16]}... is given as its own parent")
    return out


class Bookkeeper:
    """CPU tier, GPU blocks, request tables, counters and the KV event stream.

    Args:
        config: the manager's settings.
        gpu_layout: the GPU-tier KV tensors' layout.
        allocate_host: the engine's ``allocate_host`` (the CPU tier's memory).
        allocate_region: the engine's ``allocate_host_region`` where it has one (memory that
            becomes usable block range by block range; used instead of ``allocate_host``).
    """

    def __init__(
        self,
        config: ManagerConfig,
        gpu_layout: KVLayout,
        allocate_host: Callable[[int], torch.Tensor],
        allocate_region: Callable[[HostRegionLayout], HostRegion] | None = None,
    ) -> None:
        self.config = config
        self.gpu_layout = gpu_layout
        self.block_bytes = gpu_layout.block_bytes
        self.events = EventStream(config.max_events)
        self.counters = Counters()
        self.cpu_pool = HostKVPool(
            gpu_layout.page_bytes.tolist(),
            config.num_cpu_blocks,
            allocate_host,
            allocate_region=allocate_region,
        )
        memory = self.cpu_pool.memory
        self.cpu = CpuTier(
            config.num_cpu_blocks,
            config.policy,
            self.events.removed,
            config.policy_options,
            self.counters,
            blocks_ready=None if memory is None else lambda: memory.num_blocks_ready,
        )
        self.gpu = GpuBlocks(gpu_layout.num_blocks, owned=config.manage_gpu_blocks)
        self.requests = RequestTables(self.cpu, self.gpu, self.block_bytes, self.counters)
        self._threshold = config.store_threshold
        #: no admission control: the per-call fast path may be used
        self._plain_admission = config.store_threshold == 1 and not hasattr(
            self.cpu.policy, "admit"
        )
        #: called with (keys, CPU ids) of completed stores (write-through to lower tiers)
        self.on_stored: Callable[[list[bytes], np.ndarray], None] | None = None
        #: store sightings of keys not stored yet (bounded; only with store_threshold > 1)
        self._seen: dict[bytes, int] = {}

    # ------------------------------------------------------------------ validation

    def gpu_ids(self, block_ids: object, what: str) -> list[int] | np.ndarray:
        """Validated GPU ids: a list for short calls, an int64 array otherwise.

        Raises:
            InvalidBlockError: not ints, out of range, repeated, or (owned pool) not held.
        """
        if type(block_ids) is list and len(block_ids) <= SMALL:
            self.gpu.check_small(block_ids, what)
            return [int(b) for b in block_ids]  # a copy: the caller may reuse its list
        ids = as_id_array(block_ids, "gpu")
        if ids is block_ids:
            ids = ids.copy()  # the caller may reuse its array
        self.gpu.check_array(ids, what)
        return ids

    # ------------------------------------------------------------------ keyed queries

    def lookup(self, keys: Sequence[bytes], *, touch: bool) -> int:
        """Ready-prefix length; with ``touch`` the hits are touched in the policy."""
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

    # ------------------------------------------------------------------ store

    def _admitted(self, keys: list[bytes], fresh: list[int]) -> tuple[list[int], list[bytes]]:
        """Indices of ``fresh`` keys seen ``store_threshold`` times (this call included), and
        the keys whose sighting count must grow; no state changes here."""
        seen, threshold = self._seen, self._threshold
        admitted = [i for i in fresh if seen.get(keys[i], 0) + 1 >= threshold]
        waiting = [keys[i] for i in fresh if seen.get(keys[i], 0) + 1 < threshold]
        return admitted, waiting

    def _count_sightings(self, stored: list[bytes], waiting: list[bytes]) -> None:
        seen = self._seen
        for key in stored:
            seen.pop(key, None)
        for key in waiting:
            seen[key] = seen.pop(key, 0) + 1
        bound = 4 * self.cpu.num_blocks
        while len(seen) > bound:  # forget the oldest sightings
            del seen[next(iter(seen))]

    def prepare_store(
        self,
        gpu_block_ids: object,
        keys: object,
        parents: object,
        future: asyncio.Future[Any],
        *,
        batched: bool,
        held: bool = False,
        token_ids: object = None,
    ) -> Part:
        """Reserve CPU blocks for the keys not in the CPU tier yet; they become PENDING.

        ``held``: ``gpu_block_ids`` were validated by an earlier call and a waiting store holds
        them (``backpressure``), so they are not checked again (an owned block may be
        ``DRAINING`` by now: its request was freed while the store waited).

        ``token_ids`` (see ``kvmgr.events.tokens.check_token_ids``) ride in the part to the
        ``stored`` event, the rows of the keys actually stored.

        Raises:
            InvalidBlockError, InvalidKeyError: bad ids or keys, or different counts.
            InvalidArgumentError: bad ``token_ids``.
            PoolExhaustedError: no room even after eviction; nothing changed.
        """
        if (
            not batched
            and not held
            and type(gpu_block_ids) is list
            and type(keys) is list
            and parents is None
            and token_ids is None
            and 0 < len(keys) <= SMALL
            and self._plain_admission
        ):
            part = self._store_small(gpu_block_ids, keys, future)
            if part is not None:
                return part
        gpu: Any = gpu_block_ids if held else self.gpu_ids(gpu_block_ids, "store")
        keys = check_keys(keys, distinct=not batched)
        n = len(keys)
        if n != len(gpu):
            raise InvalidKeyError(
                f"expected one key per gpu block, got {n} keys and {len(gpu)} blocks"
            )
        all_parents = _parents(keys, parents)
        tokens = None if token_ids is None or n == 0 else check_token_ids(token_ids, n)
        cpu = self.cpu
        if n <= SMALL:
            index = cpu.index
            fresh = [i for i in range(n) if keys[i] not in index]
        elif cpu.index.keys().isdisjoint(keys):
            fresh = list(range(n))
        else:
            fresh = np.flatnonzero(~cpu.present(keys)).tolist()
        if batched and n > 1 and len(set(keys)) != n:  # repeats: the first occurrence only
            first = {}
            for i in fresh:
                first.setdefault(keys[i], i)
            fresh = sorted(first.values())
        if fresh:  # a parent chain reaching the key itself: InvalidKeyError, nothing changed
            if len(fresh) == n:
                cpu.chains.check(keys, all_parents)
            else:
                cpu.chains.check([keys[i] for i in fresh], [all_parents[i] for i in fresh])
        num_present = n - len(fresh)
        waiting: list[bytes] = []
        if self._threshold > 1 and fresh:
            fresh, waiting = self._admitted(keys, fresh)
        admit = getattr(cpu.policy, "admit", None)
        if admit is not None and fresh:
            mask = np.asarray(admit([keys[i] for i in fresh], [all_parents[i] for i in fresh]))
            if not mask.all():
                waiting += [keys[i] for i, ok in zip(fresh, mask.tolist()) if not ok]
                fresh = [i for i, ok in zip(fresh, mask.tolist()) if ok]
        new_keys = [keys[i] for i in fresh] if len(fresh) != n else keys
        m = len(new_keys)
        small = isinstance(gpu, list)
        # the last check: raises PoolExhaustedError with nothing changed
        cpu_ids: list[int] | np.ndarray = (
            cpu.make_room_small(m, keys) if small else cpu.make_room(m, keys)
        )
        new_parents = [all_parents[i] for i in fresh] if len(fresh) != n else all_parents
        if m:
            cpu.add_pending(new_keys, cpu_ids, new_parents)
        if tokens is not None:
            tokens = None if m == 0 else tokens if m == n else tokens[fresh]
        if self._threshold > 1:
            self._count_sightings(new_keys, waiting)
        if num_present:  # the resident part of the call's prefix was just used again
            written = frozenset(new_keys)
            index = cpu.index
            cpu.policy.touch([k for k in keys if k in index and k not in written])
        if small:
            src: list[int] | np.ndarray = gpu if m == n else [gpu[i] for i in fresh]
        else:
            src = gpu if m == n else gpu[np.array(fresh, dtype=np.int64)]
        self.gpu.acquire(src)
        counters = self.counters
        counters.stores_queued += m
        counters.stores_skipped += num_present
        counters.stores_not_admitted += n - m - num_present
        if batched:
            if m == n:  # the common case: every key stored
                stored = np.ones(n, dtype=bool)
                cpu_block_ids = np.asarray(cpu_ids, dtype=np.int64)
            else:
                stored = np.zeros(n, dtype=bool)
                stored[fresh] = True
                cpu_block_ids = np.full(n, -1, dtype=np.int64)
                cpu_block_ids[fresh] = cpu_ids
            present = ~stored
            if waiting:
                present &= cpu.present(keys)
            result: object = StoreResult(
                stored=stored,
                present=present,
                cpu_block_ids=cpu_block_ids,
                num_bytes=m * self.block_bytes,
            )
        elif small:
            result = SwapResult(m, m * self.block_bytes, n - m, tuple(cpu_ids), tuple(src))
        else:
            result = SwapResult(
                m, m * self.block_bytes, n - m, tuple(cpu_ids.tolist()), tuple(src.tolist())
            )
        chain = parents is None and m == n  # the default chain: the lane rebuilds it
        return Part(
            Kind.STORE, future, result, src, cpu_ids, new_keys,
            parents=None if chain else new_parents, token_ids=tokens,
        )  # fmt: skip

    def _store_small(
        self, gpu: list[int], keys: list[bytes], future: asyncio.Future[Any]
    ) -> Part | None:
        """The per-call store of a few fresh keys, in plain Python (evicting when the tier
        is full).

        Returns ``None`` (nothing changed) whenever the general path is needed: an id or key
        to reject, a key already present, or a key with indexed children.

        Raises:
            PoolExhaustedError: too few free and evictable CPU blocks; nothing changed.
        """
        n = len(keys)
        if len(gpu) != n:
            return None
        cpu, gpu_pool = self.cpu, self.gpu
        index, pool = cpu.index, cpu.pool
        num_gpu, gpu_state = gpu_pool.num_blocks, gpu_pool.state
        owned = gpu_pool.pool is not None
        for key, b in zip(keys, gpu):  # 1 = GpuState.HELD
            if (
                type(key) is not bytes
                or key in index
                or type(b) is not int
                or not 0 <= b < num_gpu
                or (owned and gpu_state[b] != 1)
            ):
                return None
        if n > 1 and (len(set(keys)) != n or len(set(gpu)) != n):
            return None
        if not cpu.chains.children.keys().isdisjoint(keys):
            return None  # a key with indexed children (a cycle to look for)
        if pool.num_free < n:  # the last check: raises PoolExhaustedError, nothing changed
            cpu.evict_for(n, keys)
        take_one, state, busy = pool.take_one, cpu.state, gpu_pool.busy
        cpu_ids = []
        for key, b in zip(keys, gpu):
            block = take_one()
            cpu_ids.append(block)
            index[key] = block
            state[block] = 1  # CpuState.PENDING
            busy[b] += 1
        cpu.num_pending += n
        keys = keys[:]  # the caller may reuse its lists
        parents = [None, *keys[:-1]] if n > 1 else [None]
        cpu.policy.insert(keys, parents)
        cpu.chains.add(keys, parents)
        self.counters.stores_queued += n
        gpu_ids = tuple(gpu)
        result = SwapResult(n, n * self.block_bytes, 0, tuple(cpu_ids), gpu_ids)
        return Part(Kind.STORE, future, result, list(gpu_ids), cpu_ids, keys)  # a default chain

    # ------------------------------------------------------------------ load

    def prepare_load(
        self,
        keys: object,
        gpu_block_ids: object,
        future: asyncio.Future[Any],
        *,
        batched: bool,
    ) -> Part:
        """Pin the keys' CPU blocks (one reader each) for a load into GPU blocks.

        Raises:
            InvalidBlockError, InvalidKeyError: bad ids or keys, or different counts.
            UnknownKeyError: a key is not in the CPU tier.
            BlockStateError: a key is still PENDING.
        """
        keys = check_keys(keys, distinct=False)
        gpu = self.gpu_ids(gpu_block_ids, "load")
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
        if isinstance(gpu, list):
            state = cpu.state
            ready = all(state[b] == _READY for b in cpu_list)
        else:
            cpu_arr = np.array(cpu_list, dtype=np.int64)
            ready = bool((cpu.state_np[cpu_arr] == _READY).all())
        if not ready:
            key = next(k for k, b in zip(keys, blocks) if cpu.state[b] != _READY)  # type: ignore[index]
            raise BlockStateError(f"key {key.hex()[:16]}... is still pending; it cannot be loaded")
        n = len(keys)
        cpu.add_readers(cpu_list if isinstance(gpu, list) else cpu_arr)
        if n:
            cpu.policy.touch(keys)
        self.gpu.acquire(gpu)
        self.counters.loads_queued += n
        if isinstance(gpu, list):
            result: object = (
                LoadResult(
                    gpu_block_ids=np.array(gpu, dtype=np.int64),
                    cpu_block_ids=np.array(cpu_list, dtype=np.int64),
                    num_bytes=n * self.block_bytes,
                )
                if batched
                else SwapResult(n, n * self.block_bytes, 0, tuple(cpu_list), tuple(gpu))
            )
            return Part(Kind.LOAD, future, result, gpu, cpu_list, keys)
        cpu_ids = cpu_arr
        if batched:
            result = LoadResult(
                gpu_block_ids=gpu, cpu_block_ids=cpu_ids, num_bytes=n * self.block_bytes
            )
        else:
            result = SwapResult(n, n * self.block_bytes, 0, tuple(cpu_list), tuple(gpu.tolist()))
        return Part(Kind.LOAD, future, result, gpu, cpu_ids, keys)

    # ------------------------------------------------------------------ completion

    @staticmethod
    def _store_ids(lane: Lane, cpu_ids: np.ndarray) -> np.ndarray:
        """CPU ids of the lane's keyed stores, aligned with ``lane.keys``."""
        if not lane.requests:  # stores only: the lane's ids, in part order
            return cpu_ids
        return np.concatenate(
            [np.asarray(p.cpu_ids, dtype=np.int64) for p in lane.parts if p.kind is Kind.STORE]
        )

    def _emit_stored(self, lane: Lane) -> None:
        """The ``stored`` event of a landed D2H lane: one for the lane, with the token ids
        concatenated when every keyed store gave them (of one block size) or none did; one per
        store otherwise, so that no event mixes rows with and without tokens."""
        events, keys = self.events, lane.keys
        if not events.enabled or not keys:
            return
        if lane.num_token_parts == 0:
            events.stored(keys, lane.parents)
            return
        stores = [p for p in lane.parts if p.kind is Kind.STORE and p.keys]
        tokens = [p.token_ids for p in stores if p.token_ids is not None]
        if len(tokens) == len(stores) and len({t.shape[1] for t in tokens}) == 1:
            events.stored(
                keys, lane.parents, np.concatenate(tokens) if len(tokens) > 1 else tokens[0]
            )
            return
        for part in stores:
            keys = part.keys  # type: ignore[assignment]
            parents = part.parents if part.parents is not None else [None, *keys[:-1]]
            events.stored(keys, parents, part.token_ids)

    def complete(self, lane: Lane, gpu_ids: np.ndarray, cpu_ids: np.ndarray, ok: bool) -> None:
        """Apply the outcome of a lane's copy (``ok``: it completed) to every part of it.

        ``gpu_ids``/``cpu_ids`` are the lane's ids as the batch carried them. Array operations
        over the lane's blocks, plus one step per request-level part; futures are the caller's
        to resolve after this returns.
        """
        cpu, counters = self.cpu, self.counters
        n = len(cpu_ids)
        self.gpu.release(gpu_ids)
        requests = lane.requests
        if lane.direction is Direction.D2H:
            keys = lane.keys
            if ok:
                cpu.stores_landed(cpu_ids, all_pending=not requests)  # stores stay PENDING
                counters.stores_completed += n
                self._emit_stored(lane)
                if self.on_stored is not None and keys:
                    self.on_stored(keys, self._store_ids(lane, cpu_ids))
            else:
                cpu.stores_failed(keys, cpu_ids)
                counters.stores_failed += n
            for part in requests:
                self.requests.preempt_done(part, ok)
            return
        if not requests:
            cpu.remove_readers(cpu_ids)
        else:
            loads = [
                np.asarray(p.cpu_ids, dtype=np.int64) for p in lane.parts if p.kind is Kind.LOAD
            ]
            if loads:
                cpu.remove_readers(np.concatenate(loads))
            for part in requests:
                self.requests.resume_done(part, ok)
        if ok:
            counters.loads_completed += n
        else:
            counters.loads_failed += n
