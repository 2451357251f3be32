"""The CPU tier's LRU policy kept by CPU block: a batch of stores is array operations (issue 27).

Private to ``kvmgr.scheduler``. `BlockLru` decides exactly as ``kvmgr.policy.LRUPolicy`` (the
same victims in the same order on the same calls: ``tests/scheduler/test_block_lru.py`` drives
both side by side) but holds no key-indexed structure of its own:

- the recency order is a log of CPU block ids, least recent first; ``stamp[block]`` is the log
  position of the block's one live entry (``-1``: untracked). ``insert`` and ``touch`` append
  (a touched block's older entry goes stale), ``remove`` clears stamps; the log is compacted
  (live entries moved to its front, one numpy pass) when it runs out of room;
- the tracked children of each key are the tier's ``KeyChains`` counts by block (the policy
  tracks exactly the tier's indexed keys), and a key's parent is ``KeyChains``' parent block.

``evict`` of ``n >= 2`` first tries the leading run (the first ``n`` live entries, checked with
array passes over the tier's states, reader counts and chains); otherwise it offers the live
entries one at a time in order, as ``VictimSet`` does (a key with tracked children waits until
the last one is taken). Keys are only read back (``key_of``) for the victims and the reports.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Collection, Sequence
from itertools import repeat

import numpy as np

from kvmgr._ids_c import ids_c
from kvmgr._index_c import index_c
from kvmgr.errors import UnknownKeyError
from kvmgr.policy.base import _check_evict_count
from kvmgr.scheduler.chains import KeyChains
from kvmgr.scheduler.lru_victims import CHAIN, ISOLATED, VictimSearch

__all__ = ["BlockLru"]

_FEW = 128  #: touches of up to this many keys take one Python pass (no numpy calls)


class BlockLru(VictimSearch):
    """LRU eviction of the CPU tier's keys, by CPU block (see the module docstring).

    Args:
        num_blocks: CPU blocks of the tier.
        index: the tier's key -> block dict (read, never changed here).
        chains: the tier's ``KeyChains`` (parent block and indexed children per block).
        state, readers: the tier's state bytes and reader counts (never rebound).
        ready: the state byte of READY blocks.
        can_evict: the tier's own predicate; ``evict`` given it reads the arrays instead.
    """

    name: str = "lru"

    def __init__(
        self,
        num_blocks: int,
        index: dict[bytes, int],
        chains: KeyChains,
        state: bytearray,
        readers: array.array[int],
        ready: int,
        can_evict: Callable[[bytes], bool],
    ) -> None:
        self.capacity = num_blocks
        self._index, self._chains, self._can_evict = index, chains, can_evict
        self._state, self._readers, self._ready = state, readers, ready
        self._state_np = np.frombuffer(state, dtype=np.uint8)
        self._readers_np = np.frombuffer(readers, dtype=np.int64)
        self.key_of = np.empty(num_blocks, dtype=object)  #: the key on each block (or stale)
        #: the blocks of the last ``evict``'s victims, in order (the tier frees them)
        self.victim_blocks = np.empty(0, dtype=np.int64)
        #: the last victims are one chain, its leaf first, each block's only indexed child the
        #: one before it (``KeyChains.remove_run`` then updates the chains without reading them)
        self.victim_chain = False
        #: the last victims have no indexed parent or child (``KeyChains.remove_isolated``)
        self.victim_isolated = False
        self._stamp = array.array("q", [-1]) * num_blocks
        self._stamp_np = np.frombuffer(self._stamp, dtype=np.int64)
        self._log = array.array("q", [0]) * (2 * num_blocks + 2 * _FEW)
        self._log_np = np.frombuffer(self._log, dtype=np.int64)
        self._scratch = np.zeros(num_blocks, dtype=np.int64)
        self._head = self._tail = self._len = 0
        self._lead_end = -1  #: where the run ``_leading`` last found from the head ends

    def add(
        self,
        keys: Sequence[bytes],
        blocks: list[int],
        at: np.ndarray | None = None,
        run: slice | None = None,
    ) -> None:
        """Track new keys just indexed on ``blocks`` (distinct, untracked; the tier vouches),
        the first most recent; ``at``: the same blocks as an int64 array, if the caller has one
        (``run``: they are ``arange(run.start, run.stop)``: slices, not scatters)."""
        self._len += len(blocks)
        if len(blocks) <= 8:
            for block, key in zip(blocks, keys):
                self.key_of[block] = key
            self._append_few(blocks[::-1])
        else:
            at = np.asarray(blocks, dtype=np.int64) if at is None else at
            module = index_c()  # one C loop (numpy converts the list to an array first)
            put = module is not None and type(keys) is list
            if not put or not module.put_objects(self.key_of, at if run is None else int(run.start), keys):  # fmt: skip
                self.key_of[at if run is None else run] = keys  # (the keys themselves)
            self._append(at, reverse=True, run=run)

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track keys the tier has indexed already (``parents`` are the tier's chains').

        Raises:
            UnknownKeyError: a key is not indexed by the tier. Nothing changed then.
        """
        for key in filter(lambda k: k not in self._index, keys):
            raise UnknownKeyError(f"key {key!r} is not indexed by the cpu tier")
        fresh = [k for k in dict.fromkeys(keys) if k not in self]
        self.add(fresh, [self._index[k] for k in fresh])

    def touch(self, keys: Sequence[bytes]) -> None:
        """Move the tracked ``keys`` to the MRU end, the first key last; others ignored."""
        if len(keys) == 1 and self._tail < len(self._log):  # a per-call load: no list
            block, tail = self._index.get(keys[0]), self._tail
            if block is not None and self._stamp[block] >= 0:
                self._log[tail], self._stamp[block], self._tail = block, tail, tail + 1
            return None
        if len(keys) <= _FEW:  # a repeat is appended again: its last append (its first
            get, stamp = self._index.get, self._stamp  # place in keys) is live, as move_to_end
            found = map(get, reversed(keys))
            return self._append_few([b for b in found if b is not None and stamp[b] >= 0])
        try:  # the keys of a hit: all indexed
            blocks = np.fromiter(map(self._index.__getitem__, keys), np.int64, len(keys))
        except KeyError:
            blocks = np.fromiter(map(self._index.get, keys, repeat(-1)), np.int64, len(keys))
            blocks = blocks[blocks >= 0]
        self._touch_found(blocks)

    def touch_blocks(self, keys: Sequence[bytes], blocks: np.ndarray) -> None:
        """``touch(keys)`` where the caller looked the keys up already (a batched load):
        ``blocks[i]`` (int64 ``[len(keys)]``) is ``keys[i]``'s block in the index."""
        if len(keys) <= _FEW:
            self.touch(keys)  # (its few-keys path: the same log entries)
        else:
            self._touch_found(blocks)

    def _touch_found(self, blocks: np.ndarray) -> None:
        blocks = blocks[self._stamp_np[blocks] >= 0]
        if self._num_distinct(blocks) < len(blocks):  # a key twice: its first place counts
            blocks = blocks[np.sort(np.unique(blocks, return_index=True)[1])]
        self._append(blocks, reverse=True)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking ``keys``.

        Raises:
            UnknownKeyError: If a key is not tracked; nothing changed then.
        """
        unique = list(dict.fromkeys(keys))
        for key in filter(lambda k: k not in self, unique):
            raise UnknownKeyError(f"key {key!r} is not tracked by the {self.name} policy")
        for block in map(self._index.__getitem__, unique):
            self._stamp[block] = -1
        self._len -= len(unique)

    def _num_distinct(self, blocks: np.ndarray) -> int:
        """How many distinct ids ``blocks`` holds (one surviving position per id, no sort)."""
        positions = np.arange(len(blocks), dtype=np.int64)
        self._scratch[blocks] = positions
        return int(np.count_nonzero(self._scratch[blocks] == positions))

    def _append_few(self, blocks: list[int]) -> None:
        """Append tracked blocks, the last most recent (a few: no numpy; of a block appended
        twice the last entry is the live one)."""
        if self._tail + len(blocks) > len(self._log):
            self._compact()
        log, stamp, tail = self._log, self._stamp, self._tail
        for block in blocks:
            log[tail] = block
            stamp[block] = tail
            tail += 1
        self._tail = tail

    def _append(
        self, blocks: np.ndarray, *, reverse: bool = False, run: slice | None = None
    ) -> None:
        """Append distinct tracked blocks (int64), the last most recent (``reverse``: the
        first; a reversed view would make the stamps' scatter several times slower; ``run``:
        ``blocks`` as a slice)."""
        m = len(blocks)
        if self._tail + m > len(self._log):
            self._compact()
        t = self._tail
        if reverse:
            self._log_np[t : t + m] = blocks[::-1]
            at = blocks if run is None else run
            self._stamp_np[at] = np.arange(t + m - 1, t - 1, -1, dtype=np.int64)
        else:
            self._log_np[t : t + m] = blocks
            self._stamp_np[blocks] = np.arange(t, t + m, dtype=np.int64)
        self._tail = t + m

    def _compact(self) -> None:
        """Move the live entries to the front of the log (room for ``num_blocks + 2 * _FEW``
        more: a touch of up to ``_FEW`` keys, repeats included, always fits)."""
        live = self._live_positions(self._head, self._tail)
        blocks = self._log_np[live]
        m = len(blocks)
        self._log_np[:m] = blocks
        self._stamp_np[blocks] = np.arange(m, dtype=np.int64)
        self._head, self._tail = 0, m

    def _live_positions(self, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop, dtype=np.int64)
        return pos[self._stamp_np[self._log_np[start:stop]] == pos]

    def evict(
        self, n: int, can_evict: Callable[[bytes], bool], protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return the ``n`` least recently used evictable leaves, or ``None``
        (fewer qualify; nothing changed). See ``EvictionPolicy.evict``.

        Raises:
            ValueError: If ``n`` is negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        if n > self._len:
            return None
        get = self._index.get
        guarded = {b for b in map(get, protected) if b is not None} if protected else set()
        own = can_evict is self._can_evict
        victims, kind = self._leading_run(n, guarded) if own and n >= 2 else (None, 0)
        self.victim_chain, self.victim_isolated = kind == CHAIN, kind == ISOLATED
        if victims is None:
            victims = self._collect(n, None if own else can_evict, guarded)
            if victims is None:
                return None
            stamp = self._stamp
            for block in victims:
                stamp[block] = -1
            self.victim_blocks = np.array(victims, dtype=np.int64)
            self._len -= n
            return list(map(self.key_of.__getitem__, victims))
        self._stamp_np[victims] = -1
        if self._lead_end >= 0:  # the run was the entries from the head: skip them now
            self._head = self._lead_end
        self.victim_blocks = victims
        self._len -= n
        return self.key_of[victims].tolist()  # type: ignore[no-any-return]

    def _leading(self, n: int) -> np.ndarray:
        """The blocks of the first ``n`` live entries (fewer when the log holds fewer): the
        ``n`` entries from the head when all are live (one check), else ``_first_live``'s."""
        head = self._head
        if head + n <= self._tail:
            run: np.ndarray = self._log_np[head : head + n]
            module = ids_c()  # one C loop where it builds (None: undecided, numpy decides)
            live = None if module is None else module.live_run(self._log, self._stamp, head, n)
            if live is None:
                live = (self._stamp_np[run] == np.arange(head, head + n, dtype=np.int64)).all()
            if live:
                self._lead_end = head + n  # evicted, they leave stale entries before it
                return run.copy()  # the head is live: ``_first_live`` would keep it
        self._lead_end = -1
        found: np.ndarray = self._log_np[self._first_live(n)]
        return found

    def _first_live(self, n: int) -> np.ndarray:
        """Log positions of the first ``n`` live entries (fewer when the log holds fewer);
        the head skips the stale entries before the first."""
        head, tail = self._head, self._tail
        width = min(tail - head, max(2 * n, 64))
        while True:
            live = self._live_positions(head, head + width)
            if len(live) >= n or head + width >= tail:
                break
            width = min(tail - head, 2 * width)
        if len(live):
            self._head = int(live[0])
        return live[:n]

    def ordered_keys(self) -> list[bytes]:
        """Tracked keys from least to most recently used (for tests and reports); O(len)."""
        live = self._live_positions(self._head, self._tail)
        return [self.key_of[b] for b in self._log_np[live].tolist()]  # type: ignore[misc]

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: object) -> bool:
        block = self._index.get(key)  # type: ignore[call-overload]
        return block is not None and self._stamp[block] >= 0

    def __repr__(self) -> str:
        return f"BlockLru(capacity={self.capacity}, num_keys={self._len})"
