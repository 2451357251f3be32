"""``BlockLru.evict``'s two ways of finding victims, by CPU block (issue 27).

Private to ``kvmgr.scheduler``: ``VictimSearch``, the base of ``BlockLru`` that holds
``_leading_run`` (the first ``n`` live entries of the log, when one offer at a time would take
exactly them: array passes) and ``_collect`` (``VictimSet``'s offers one live entry at a time,
in order). Neither changes the policy: ``evict`` does. The state they read is ``BlockLru``'s,
declared here by type only (``BlockLru.__init__`` makes it).
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvmgr._ids_c import ids_c

if TYPE_CHECKING:
    from kvmgr.scheduler.chains import KeyChains

__all__ = ["CHAIN", "ISOLATED", "VictimSearch"]

CHAIN, ISOLATED = 1, 2  #: what ``_leading_run``'s run is (0: neither)


class VictimSearch:
    """The victim search of ``BlockLru`` (its base class; never made alone)."""

    _log: array.array[int]
    _stamp: array.array[int]
    _state: bytearray
    _readers: array.array[int]
    _ready: int
    key_of: np.ndarray
    _head: int
    _tail: int
    _state_np: np.ndarray
    _log_np: np.ndarray
    _stamp_np: np.ndarray
    _readers_np: np.ndarray
    _chains: KeyChains
    _scratch: np.ndarray
    _leading: Callable[[int], np.ndarray]  # BlockLru's method: the run of live blocks from the head

    def _leading_run(self, n: int, guarded: set[int]) -> tuple[np.ndarray | None, int]:
        """The first ``n`` live blocks when one offer at a time would take exactly them, in
        order: each READY without readers and not protected, every indexed child of each in
        the run and before it; ``None`` otherwise (nothing changed). And what the run is:
        ``CHAIN`` (one chain, its leaf first, each block's only indexed child the one before
        it), ``ISOLATED`` (no block with an indexed parent or child; found by the C pass only)
        or 0."""
        run = self._leading(n)
        module = ids_c()  # the common case's checks in one C loop where it builds
        if len(run) == n and module is not None and (not guarded or guarded.isdisjoint(run.tolist())):  # fmt: skip
            chains = self._chains
            args = (run, self._state, self._ready, self._readers, chains._up_block, chains._kids)
            if module.chain_ok(*args):
                return run, CHAIN
            kind = module.leaves_ok(*args)  # no indexed child in the run (per-call roots)
            if kind:
                return run, ISOLATED if kind == 2 else 0
        if len(run) < n or not (self._state_np[run] == self._ready).all():
            return None, 0
        if self._readers_np[run].any() or (guarded and not guarded.isdisjoint(run.tolist())):
            return None, 0
        up, kids = self._chains._up_np[run], self._chains._kids_np[run]
        if (up[:-1] == run[1:]).all() and kids[0] == 0 and (kids[1:] == 1).all():
            return run, CHAIN  # one chain, its leaf first, no child outside it (the common case)
        scratch, order = self._scratch, np.arange(n, dtype=np.int64)
        scratch[run] = order
        linked = up >= 0
        at = np.minimum(scratch[np.where(linked, up, 0)], n - 1)
        inside = linked & (run[at] == up)  # the parent is a run block, at position ``at``
        if not (at[inside] > order[inside]).all():  # a parent before its child would wait
            return None, 0
        counts = np.bincount(at[inside], minlength=n)
        if not (counts == kids).all():  # a child outside the run
            return None, 0
        return run, 0

    def _collect(
        self, n: int, can_evict: Callable[[bytes], bool] | None, guarded: set[int]
    ) -> list[int] | None:
        """``VictimSet.offer_all`` over the live entries in order, by block: the ``n``
        victims, or ``None``. Child counts change only in a local overlay (``left``).
        Without a key predicate (the tier's own: the arrays), ``_collect_leaves``."""
        self._skip_stale_head()
        if can_evict is None:
            return self._collect_leaves(n, guarded)
        log, stamp, up_of, kids = self._log, self._stamp, self._chains._up_block, self._chains._kids
        state, readers, ready, key_of = self._state, self._readers, self._ready, self.key_of
        left: dict[int, int] = {}
        waiting: set[int] = set()
        victims: list[int] = []
        for pos in range(self._head, self._tail):
            block = log[pos]
            if stamp[block] != pos or block in guarded:
                continue
            if can_evict is None:
                if state[block] != ready or readers[block]:
                    continue
            elif not can_evict(key_of[block]):
                continue
            if left.get(block, kids[block]) > 0:
                waiting.add(block)
                continue
            while True:  # take the block and each waiting ancestor its removal frees
                victims.append(block)
                up = up_of[block]
                if up < 0:
                    break
                count = left[up] = left.get(up, kids[up]) - 1
                if count > 0 or up not in waiting or len(victims) >= n:
                    break
                waiting.discard(up)
                block = up
            if len(victims) >= n:
                return victims
        return None

    def _skip_stale_head(self) -> None:
        """Move the head past the log's leading stale entries."""
        log, stamp, head = self._log, self._stamp, self._head
        while head < self._tail and stamp[log[head]] != head:
            head += 1
        self._head = head

    def _collect_leaves(self, n: int, guarded: set[int]) -> list[int] | None:
        """``_collect`` without a key predicate, the same victims in the same order, where
        the log is read by numpy chunks and only the entries that can be taken as they come
        are looked at in Python: live, READY, without readers, without indexed children.

        ``_collect``'s scan offers every live entry; one with children waits until its last
        child is taken. A waiting entry is taken right after that child (``_take_up``: it was
        offered before, so it lies before the current position, and it was evictable); an
        entry whose last child is taken before the scan reaches it becomes a leaf there
        (``late``: a heap by log position, merged into the scan). On a long trace most of the
        log is stale entries and parents waiting on recent children (``kvmgr simulate``: 389k
        positions a call for 107 victims), which the chunks skip without Python."""
        victims: list[int] = []
        left: dict[int, int] = {}
        late: list[tuple[int, int]] = []
        for pos, block in self._leaf_entries(n):
            while late and late[0][0] < pos:
                if self._take_up(heapq.heappop(late), victims, left, late, n, guarded):
                    return victims
            if block in guarded:
                continue
            if self._take_up((pos, block), victims, left, late, n, guarded):
                return victims
        while late:
            if self._take_up(heapq.heappop(late), victims, left, late, n, guarded):
                return victims
        return None

    def _take_up(
        self,
        entry: tuple[int, int],
        victims: list[int],
        left: dict[int, int],
        late: list[tuple[int, int]],
        n: int,
        guarded: set[int],
    ) -> bool:
        """Take the block of ``entry`` (its log position, block) and each ancestor its removal
        frees that was offered before (waiting); push a freed ancestor not offered yet onto
        ``late``. Whether ``n`` victims are taken."""
        pos, block = entry
        up_of, kids, stamp = self._chains._up_block, self._chains._kids, self._stamp
        state, readers, ready = self._state, self._readers, self._ready
        while True:
            victims.append(block)
            if len(victims) >= n:
                return True
            up = up_of[block]
            if up < 0:
                return False
            count = left[up] = left.get(up, kids[up]) - 1
            at = stamp[up]
            if count > 0 or at < 0 or state[up] != ready or readers[up] or up in guarded:
                return False  # still has children, or could not be taken (never waited)
            if at > pos:  # not offered yet: a leaf when the scan gets there
                heapq.heappush(late, (at, up))
                return False
            block = up

    @staticmethod
    def _first_chunk(n: int) -> int:
        """Log entries read by ``_leaf_entries``' first chunk (each next one twice as many)."""
        return max(4 * n, 1024)

    def _leaf_entries(self, n: int) -> Iterator[tuple[int, int]]:
        """(log position, block) of the live READY entries without readers or indexed children,
        from the head in order: numpy chunks of growing width."""
        log_np, stamp_np, kids_np = self._log_np, self._stamp_np, self._chains._kids_np
        state_np, readers_np, ready = self._state_np, self._readers_np, self._ready
        start, tail, width = self._head, self._tail, self._first_chunk(n)
        while start < tail:
            stop = min(tail, start + width)
            blocks = log_np[start:stop]
            take = stamp_np[blocks] == np.arange(start, stop, dtype=np.int64)
            take &= state_np[blocks] == ready
            take &= readers_np[blocks] == 0
            take &= kids_np[blocks] == 0
            at = np.flatnonzero(take)
            yield from zip((at + start).tolist(), blocks[at].tolist())
            start, width = stop, 2 * width
