"""The CPU tier's bookkeeping: block states, the key index, readers, eviction through a policy.

Private to ``kvmgr.scheduler``. States of a CPU block (``CpuState``):

- ``FREE``: in the allocator.
- ``PENDING``: keyed; a store copy writes it. Not readable, not evictable.
- ``READY``: keyed; readable. With ``readers > 0`` (loads in flight) it is not evictable.
- ``PREEMPTING``: a preempt copy writes a request's block into it.
- ``SWAPPED``: holds a block of a preempted request (its block table points here).
- ``RESUMING``: a resume copy reads it back to the GPU; FREE once that completes.

Keyed blocks are found through ``index`` (a plain ``dict[bytes, int]``, key -> CPU block). The
state bytes and reader counts are buffers with numpy views, so a batch is one array operation
and a single block is one index operation. ``reserved`` blocks are promised to recorded
per-call stores (``deferred``): every allocation keeps them free or evictable.
"""

from __future__ import annotations

import array
import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from kvmgr.errors import BlockStateError
from kvmgr.policy import make_policy
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.scheduler.block_lru import BlockLru
from kvmgr.scheduler.chains import KeyChains
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.cpu_readers import ReaderCounts
from kvmgr.scheduler.evictable import evictable, no_room
from kvmgr.scheduler.key_index import set_items

__all__ = ["CpuState", "CpuTier"]


class CpuState(enum.IntEnum):
    """State of a CPU block (see the module docstring)."""

    FREE = 0
    PENDING = 1
    READY = 2
    PREEMPTING = 3
    SWAPPED = 4
    RESUMING = 5


_READY, _PENDING = int(CpuState.READY), int(CpuState.PENDING)  # plain ints: array compares


class CpuTier(ReaderCounts):
    """Blocks, keys and eviction of the CPU tier.

    Args:
        num_blocks: CPU blocks.
        policy: registry name of the eviction policy.
        on_removed: called with the keys evicted, in eviction order (the KV event stream).
        policy_options: keyword arguments of the policy's constructor.
        counters: where evictions are counted.
        blocks_ready: how many leading blocks the memory lets the allocator hand out now (the
            region is still being pinned); ``None``: all of them. Asked when room runs short.
        keep_evicted: record the (keys, CPU ids) of the blocks the policy evicts in
            ``evicted`` (data the owner takes with ``take_evicted``: lower tiers write them
            back before anything overwrites the freed blocks).
        by_block: ``policy="lru"`` without options is kept by CPU block (``BlockLru``: the same
            decisions, array operations for a batch); ``False``: the key-based ``LRUPolicy``.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: str,
        on_removed: Callable[[list[bytes]], None],
        policy_options: Mapping[str, Any] | None = None,
        counters: Counters | None = None,
        blocks_ready: Callable[[], int] | None = None,
        *,
        keep_evicted: bool = False,
        by_block: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        ready = num_blocks if blocks_ready is None else blocks_ready()
        self.pool = BlockAllocator(num_blocks, name="cpu", num_ready=ready)
        self._blocks_ready = blocks_ready if ready < num_blocks else None
        self.index: dict[bytes, int] = {}
        #: the parent of every indexed key (refuses key cycles)
        self.chains = KeyChains(num_blocks, self.index)
        self.state = bytearray(num_blocks)
        self.state_np = np.frombuffer(self.state, dtype=np.uint8)
        self.readers = array.array("q", [0]) * num_blocks
        self.readers_np = np.frombuffer(self.readers, dtype=np.int64)
        #: READY and no reader: the policy's ``can_evict`` (a closure, asked once per candidate)
        self.can_evict = evictable(self.index, self.state, self.readers, _READY)
        by_block = by_block and policy == "lru" and not policy_options  # the policy by block
        self._lru = BlockLru(num_blocks, self.index, self.chains, self.state, self.readers,
                             _READY, self.can_evict) if by_block else None  # fmt: skip
        self.policy: Any = (self._lru if self._lru is not None  # (an empty one is falsy)
                            else make_policy(policy, num_blocks, **(policy_options or {})))  # fmt: skip
        self.num_pending = 0
        self.num_loading = 0  #: READY blocks with readers
        self.reserved = 0  #: blocks promised to recorded per-call stores (``deferred``)
        self._on_removed = on_removed
        self._keep_evicted = keep_evicted
        #: (keys, CPU ids) of blocks the policy evicted since ``take_evicted`` (freed, not
        #: overwritten yet; only with ``keep_evicted``)
        self.evicted: list[tuple[list[bytes], np.ndarray]] = []
        self.counters = counters if counters is not None else Counters()

    def ready_prefix(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of READY keys."""
        get, state, hits = self.index.get, self.state, 0
        for key in keys:
            block = get(key)
            if block is None or state[block] != _READY:
                break
            hits += 1
        return hits

    def make_room(self, n: int, protected: Collection[bytes]) -> np.ndarray:
        """Allocate ``n`` CPU blocks (state unchanged: the caller sets it), evicting READY
        blocks without readers if needed; all or nothing.

        Raises:
            PoolExhaustedError: (reason ``"cpu_full"``) too few free and evictable blocks.
        """
        self.evict_for(n, protected)
        return self.pool.take(n)  # type: ignore[return-value]  # room was made: never None

    def grow(self) -> bool:
        """Let the allocator hand out the blocks pinned since the last call; whether any."""
        ready = self.pool.num_ready if self._blocks_ready is None else self._blocks_ready()
        if ready <= self.pool.num_ready:  # all pinned before, or nothing new
            return False
        self.pool.make_ready(ready)
        if ready >= self.num_blocks:
            self._blocks_ready = None  # all pinned: never ask again
        return True

    def blocks_to_grow(self) -> int:
        """Blocks pinned since the allocator last grew (``grow`` would add them); no change."""
        ready = self._blocks_ready
        return 0 if ready is None else max(0, ready() - self.pool.num_ready)

    def evict_for(self, n: int, protected: Collection[bytes]) -> None:
        """Make ``n`` CPU blocks free, evicting READY blocks without readers if needed.

        Raises:
            PoolExhaustedError: too few free and evictable blocks; nothing changed then.
        """
        total = n + self.reserved  # the room promised to recorded stores stays free or evictable
        shortfall = total - self.pool.num_free
        if shortfall > 0 and self.grow():
            shortfall = total - self.pool.num_free
        if shortfall > 0:
            victims = self.policy.evict(shortfall, self.can_evict, protected)
            if victims is None:  # this call's need (backpressure="wait" compares it), not total
                free = max(0, self.pool.num_free - self.reserved)
                raise no_room(n, free, self.pool.num_ready, self.num_blocks)
            if self._keep_evicted:
                ids = np.fromiter(map(self.index.__getitem__, victims), np.int64, len(victims))
                self.evicted.append((list(victims), ids))
            lru = self._lru
            if lru is None:
                self._forget(victims)
            else:
                self._forget(victims, lru.victim_blocks, chain=lru.victim_chain,
                             isolated=lru.victim_isolated)  # fmt: skip
            self.counters.evictions += len(victims)

    def take_evicted(self) -> list[tuple[list[bytes], np.ndarray]]:
        """Remove and return the evictions recorded since the last call, oldest first."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def make_room_small(self, n: int, protected: Collection[bytes]) -> list[int]:
        """``make_room`` for a few blocks, without numpy (the per-call path)."""
        if n + self.reserved > self.pool.num_free:
            self.evict_for(n, protected)
        return self.pool.take_few(n)

    def _forget(self, keys: list[bytes], ids: np.ndarray | None = None, *, chain: bool = False,
                isolated: bool = False) -> None:  # fmt: skip
        """Drop READY keys without readers (already untracked by the policy), on blocks
        ``ids`` when the caller knows them (in key order; ``chain``: one chain, ``isolated``:
        no indexed parent or child, as ``BlockLru.victim_chain`` / ``victim_isolated`` say);
        free the blocks."""
        if len(keys) <= 8:
            state, free = self.state, CpuState.FREE
            blocks = list(map(self.index.pop, keys))
            self.chains.remove(keys, blocks)
            for block in blocks:
                state[block] = free
            self.pool.give_few(blocks)
        else:
            if ids is None:
                ids = np.fromiter(map(self.index.pop, keys), dtype=np.int64, count=len(keys))
            else:
                set_items(self.index, keys, None)
            if chain:
                self.chains.remove_run(ids)
            elif isolated:
                self.chains.remove_isolated(ids)
            else:
                self.chains.remove(keys, ids)
            self.state_np[ids] = CpuState.FREE
            self.pool.give(ids, vouched=True)  # the distinct blocks of keys just unindexed
        self._on_removed(keys)

    def add_pending(self, keys: list[bytes], ids: list[int] | np.ndarray,
                    parents: Sequence[bytes | None] | None, *, vouched: bool = False,
                    indexed: list[int] | None = None,
                    run: slice | None = None) -> None:  # fmt: skip
        """Index and track new distinct keys, PENDING on their new blocks (all or nothing;
        ``parents`` ``None``: the default chain). ``vouched``: the caller saw the keys absent
        since the index last gained one (as ``Stores.prepare`` does), so they are not checked
        again (BlockStateError otherwise); ``indexed``: ``ids`` (an array) as a list, on
        which ``fresh_store.add_new`` put them; ``run``: ``ids`` is ``arange`` of its bounds."""
        index = self.index
        if not vouched and indexed is None and not index.keys().isdisjoint(keys):  # a bug
            raise BlockStateError(f"cpu tier: key {next(filter(index.__contains__, keys))!r} "
                                  "is indexed already")  # fmt: skip
        if self._lru is None:
            self._track(keys, [None, *keys[:-1]] if parents is None else parents)
        if isinstance(ids, list):
            blocks, state = ids, self.state
            for key, block in zip(keys, ids):
                index[key] = block
                state[block] = _PENDING
        else:
            blocks = ids.tolist() if indexed is None else indexed
            if blocks is not indexed:
                index.update(zip(keys, blocks))
            self.state_np[ids if run is None else run] = _PENDING  # (a plain int: no enum)
        self.num_pending += len(keys)
        self.chains.add(keys, blocks, parents, at := None if blocks is ids else ids, run)  # type: ignore[arg-type]
        if self._lru is not None:  # by block: tracked once indexed
            self._lru.add(keys, blocks, at, run)  # type: ignore[arg-type]

    def _track(self, keys: list[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys in a key-based policy (its unchecked ``insert_new`` when it has
        one; ``chains.orphans``: whether a new key has a tracked child); it may refuse."""
        insert_new, orphans = getattr(self.policy, "insert_new", None), self.chains.orphans
        if insert_new is None:
            return self.policy.insert(keys, parents)  # type: ignore[no-any-return]
        childless = orphans is not None and (not orphans or orphans.keys().isdisjoint(keys))
        insert_new(keys, parents, childless=childless)

    def stores_landed(self, ids: np.ndarray, *, all_pending: bool = False) -> None:
        """Store and preempt copies into ``ids`` completed: PENDING -> READY,
        PREEMPTING -> SWAPPED. ``all_pending``: the caller knows every block is PENDING (keyed
        stores only), so the states are written without being read first."""
        if all_pending:
            self.num_pending -= len(ids)
            self.state_np[ids] = _READY
            return
        states = self.state_np[ids]
        pending = states == _PENDING
        num_pending = int(np.count_nonzero(pending))
        self.num_pending -= num_pending
        if num_pending == len(ids):
            self.state_np[ids] = CpuState.READY
        else:
            self.state_np[ids] = np.where(pending, _READY, int(CpuState.SWAPPED))

    def stores_failed(self, keys: list[bytes], ids: np.ndarray) -> None:
        """Store and preempt copies into ``ids`` failed: drop their keys and free the blocks."""
        if keys:
            self.policy.remove(keys)  # first: a policy by block finds the keys' blocks
            blocks = list(map(self.index.pop, keys))
            self.chains.remove(keys, blocks)
        self.num_pending -= int(np.count_nonzero(self.state_np[ids] == _PENDING))
        self.state_np[ids] = CpuState.FREE
        self.pool.give(ids)

    def set_state(self, ids: np.ndarray, state: CpuState) -> None:
        self.state_np[ids] = state

    def release(self, ids: np.ndarray) -> None:
        """Free request blocks (a swapped-out request freed or resumed)."""
        self.state_np[ids] = CpuState.FREE
        self.pool.give(ids)

    def drop(self, keys: list[bytes]) -> None:
        """Untrack and forget READY keys without readers (``invalidate``)."""
        self.policy.remove(keys)
        self._forget(keys)
