"""The CPU-tier part of a batched store whose keys are all new, in one pass (issue 27).

Private to ``kvmgr.scheduler``. ``add_new`` is a store's whole CPU-tier part when no key is
indexed yet and none repeats, as in every round of ``kvmgr bench host``'s batched store: when
the free blocks hold the keys, the blocks ``make_room`` would take are looked at, not taken,
and the keys indexed on them with ``key_index.add_absent``; only then are the blocks taken.
When blocks must be evicted first, the keys are indexed on a placeholder (``-1``) while the
policy evicts, then on their blocks (a second pass, in place). The settle of recorded per-call
stores (``kvmgr.scheduler.settle``) indexes its keys in another order than it takes their blocks:
``order``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvmgr.scheduler.key_index import add_absent, drop_last, int_list, set_items

if TYPE_CHECKING:
    from kvmgr.scheduler.cpu_tier import CpuTier

__all__ = ["add_new"]


def add_new(
    cpu: CpuTier,
    keys: list[bytes],
    parents: Sequence[bytes | None] | None,
    order: slice | np.ndarray | None = None,
) -> np.ndarray | None:
    """``cpu.add_pending(keys, cpu.make_room(len(keys), ()), parents)`` when every key is
    absent and distinct, found out by indexing them (``add_absent``); the new CPU blocks
    (int64), or ``None`` with nothing changed (the caller takes the general path). ``order``:
    ``keys[j]`` goes on block ``ids[order][j]`` of the blocks ``ids`` returned (default: on
    ``ids[j]``), as ``add_pending(keys, ids[order], parents)`` (a permutation of ``len(keys)``).

    Raises:
        PoolExhaustedError: too few free and evictable blocks (``make_room``); nothing changed.
        whatever the policy's ``insert`` raises (``add_pending``): nothing changed (where
            blocks had to be evicted first, those evictions and the blocks taken stay, as in
            the general path).
    """
    n, pool, index = len(keys), cpu.pool, cpu.index
    room = n + cpu.reserved <= pool.num_free
    if room:  # no eviction: the keys go on the blocks ``make_room`` would take
        ids = pool.peek(n)
        start = None if order is not None else pool.fresh_start(n)  # ``ids`` a run: slices
        run = None if start is None else slice(start, start + n)  # instead of gathers, scatters
        at = ids if order is None else np.ascontiguousarray(ids[order])
        blocks = int_list(at if run is None else run, pool.num_blocks)
        if not add_absent(index, keys, blocks):
            return None
    else:  # the keys wait on a placeholder while the policy evicts (they are not its victims)
        if not add_absent(index, keys, -1):
            return None
        try:
            ids, run = cpu.make_room(n, ()), None
        except BaseException:  # PoolExhaustedError: nothing evicted
            drop_last(index, n)
            raise
        at = ids if order is None else np.ascontiguousarray(ids[order])
        blocks = int_list(at, pool.num_blocks)
        set_items(index, keys, blocks)  # in place: the order stays
    try:
        cpu.add_pending(keys, at, parents, indexed=blocks, run=run)
    except BaseException:  # the policy refused the keys (its insert comes first)
        drop_last(index, n)
        raise
    if room:
        pool.commit(ids if run is None else run)
    return ids
