"""``BlockLru.evict``'s two ways of finding victims, by CPU block (issue 27).

Private to ``kvmgr.scheduler``: ``VictimSearch``, the base of ``BlockLru`` that holds
``_leading_run`` (the first ``n`` live entries of the log, when one offer at a time would take
exactly them: array passes) and ``_collect`` (``VictimSet``'s offers one live entry at a time,
in order). Neither changes the policy: ``evict`` does. The state they read is ``BlockLru``'s,
declared here by type only (``BlockLru.__init__`` makes it).
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvmgr.scheduler.chains import KeyChains

__all__ = ["VictimSearch"]


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
    _readers_np: np.ndarray
    _chains: KeyChains
    _scratch: np.ndarray
    _leading: Callable[[int], np.ndarray]  # BlockLru's method: the run of live blocks from the head

    def _leading_run(self, n: int, guarded: set[int]) -> tuple[np.ndarray | None, bool]:
        """The first ``n`` live blocks when one offer at a time would take exactly them, in
        order: each READY without readers and not protected, every indexed child of each in
        the run and before it; ``None`` otherwise (nothing changed). And whether the run is one
        chain, its leaf first, each block's only indexed child the one before it."""
        run = self._leading(n)
        if len(run) < n or not (self._state_np[run] == self._ready).all():
            return None, False
        if self._readers_np[run].any() or (guarded and not guarded.isdisjoint(run.tolist())):
            return None, False
        up, kids = self._chains._up_np[run], self._chains._kids_np[run]
        if (up[:-1] == run[1:]).all() and kids[0] == 0 and (kids[1:] == 1).all():
            return run, True  # one chain, its leaf first, no child outside it (the common case)
        scratch, order = self._scratch, np.arange(n, dtype=np.int64)
        scratch[run] = order
        linked = up >= 0
        at = np.minimum(scratch[np.where(linked, up, 0)], n - 1)
        inside = linked & (run[at] == up)  # the parent is a run block, at position ``at``
        if not (at[inside] > order[inside]).all():  # a parent before its child would wait
            return None, False
        counts = np.bincount(at[inside], minlength=n)
        if not (counts == kids).all():  # a child outside the run
            return None, False
        return run, False

    def _collect(
        self, n: int, can_evict: Callable[[bytes], bool] | None, guarded: set[int]
    ) -> list[int] | None:
        """``VictimSet.offer_all`` over the live entries in order, by block: the ``n``
        victims, or ``None``. Child counts change only in a local overlay (``left``)."""
        log, stamp, up_of, kids = self._log, self._stamp, self._chains._up_block, self._chains._kids
        state, readers, ready, key_of = self._state, self._readers, self._ready, self.key_of
        head = self._head
        while head < self._tail and stamp[log[head]] != head:
            head += 1
        self._head = head
        left: dict[int, int] = {}
        waiting: set[int] = set()
        victims: list[int] = []
        for pos in range(head, self._tail):
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
