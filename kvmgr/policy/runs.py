"""Eviction of a leading run: the first ``n`` keys of a policy's order, checked with array passes.

Offers `leading_run`, the fast path of a policy's ``evict`` when the victims `VictimSet` would
take are simply the first ``n`` keys of its order (the common case of a full tier: whole old
prefixes aged out together, their leaves first). It decides with C-level passes over the ``n``
keys (no Python step per key) and the manager's batch test ``can_evict.every`` (a numpy pass
over block states); when it cannot tell, it returns ``None`` having changed nothing, and the
policy collects the victims one offer at a time as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from itertools import compress, islice, repeat
from operator import itemgetter
from typing import Any

import numpy as np

from kvmgr.policy.base import KeyPredicate, _as_lookup
from kvmgr.policy.tree import PrefixTree

__all__ = ["leading_run"]

_key, _parent = itemgetter(0), itemgetter(1)


def leading_run(
    order: Mapping[bytes, bytes | None],
    n: int,
    tree: PrefixTree,
    can_evict: KeyPredicate,
    protected: Collection[bytes],
) -> list[bytes] | None:
    """The ``n`` victims `VictimSet.offer_all` would take from ``order``, when they are its
    first ``n`` keys, with the tree's child counts released; else ``None``, nothing changed.

    They are when each of the first ``n`` keys is evictable (``can_evict.every(keys)``: the
    manager's batch form of ``can_evict``; a predicate without it never takes this path) and
    not protected, and all its tracked children come before it among them: then no key waits,
    so one offer at a time takes exactly those keys, in order.

    Args:
        order: tracked key -> parent, in the policy's eviction order (first = next victim).
        n: victims wanted (``>= 2``; smaller counts return ``None``).
        tree: the policy's child counts (released for the victims on success).
        can_evict, protected: as `EvictionPolicy.evict`.
    """
    every = getattr(can_evict, "every", None)
    if every is None or n < 2 or len(order) < n:
        return None
    items = list(islice(order.items(), n))
    run = list(map(_key, items))
    if run[0] in tree.num_children:  # the first key waits for a child: not a run (cheap exit)
        return None
    if protected and not _as_lookup(protected).isdisjoint(run):
        return None
    ups = list(map(_parent, items))
    kids = list(map(tree.num_children.get, run, repeat(0)))
    outside = _parents_outside(run, ups, kids)
    if outside is None or not every(run):
        return None
    deque(map(tree.num_children.__delitem__, compress(run, kids)), 0)  # they lose every child
    tree.release([ups[i] for i in outside.tolist()])  # parents outside: one child each
    return run


def _parents_outside(run: list[bytes], ups: list[bytes | None], kids: list[int]) -> Any:
    """int64 positions of the run keys whose parent is outside the run (or a root), when
    every parent in the run comes after its children and every tracked child of a run key
    (``kids``: their counts) is in the run; else ``None``."""
    n = len(run)
    position = dict(zip(run, range(n)))
    at = np.fromiter(map(position.get, ups, repeat(n)), dtype=np.int64, count=n)
    if not (at > np.arange(n)).all():  # a parent before its child would wait
        return None
    outside = np.flatnonzero(at == n)
    # the children the tree counts equal the run keys whose parent is in the run
    return outside if sum(kids) == n - len(outside) else None
