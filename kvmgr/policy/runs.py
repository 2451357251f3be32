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
from collections.abc import Callable, Collection, Mapping
from itertools import compress, islice, repeat

import numpy as np

from kvmgr.policy.base import KeyPredicate, _as_lookup
from kvmgr.policy.tree import PrefixTree

__all__ = ["leading_run"]


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
    num_children = tree.num_children
    run = list(islice(order, n))
    if run[0] in num_children:  # the first key waits for a child: not a run (cheap exit)
        return None
    if protected and not _as_lookup(protected).isdisjoint(run):
        return None
    ups = list(islice(order.values(), n))
    if ups[:-1] == run[1:]:  # one chain, its leaf first (the common full tier)
        return _chain(run, ups[-1], tree, every)
    kids = list(map(num_children.get, run, repeat(0)))
    outside = _parents_outside(run, ups, kids)
    if outside is None or not every(run):
        return None
    deque(map(num_children.__delitem__, compress(run, kids)), 0)  # they lose every child
    tree.release(outside)  # parents outside the run: one child each
    return run


def _chain(
    run: list[bytes], up: bytes | None, tree: PrefixTree, every: Callable[[list[bytes]], bool]
) -> list[bytes] | None:
    """`leading_run` for one chain ``run`` (each key's parent the next key; the last key's
    parent ``up``; the first key childless): a run when every key is evictable and each key
    after the first has one tracked child (the key before it). Its counts are popped in one
    pass and put back when some key has another child."""
    if not every(run):
        return None
    num_children = tree.num_children
    counts = list(map(num_children.pop, islice(run, 1, None)))  # each has its chain child
    if sum(counts) != len(run) - 1:  # a child outside the run: that key would wait
        num_children.update(zip(islice(run, 1, None), counts))
        return None
    tree.release((up,))  # the parent outside the run loses one child
    return run


def _parents_outside(
    run: list[bytes], ups: list[bytes | None], kids: list[int]
) -> list[bytes | None] | None:
    """The parents (``ups``, one per run key) outside the run, one per child, when every
    parent in the run comes after its children and every tracked child of a run key (``kids``:
    their counts) is in the run; else ``None``. Roots only are told without a position per
    key (one chain is `_chain`'s)."""
    n = len(run)
    if ups.count(None) == n:  # roots (one-block stores)
        return [] if not any(kids) else None
    position = dict(zip(run, range(n)))
    at = np.fromiter(map(position.get, ups, repeat(n)), dtype=np.int64, count=n)
    if not (at > np.arange(n)).all():  # a parent before its child would wait
        return None
    outside = np.flatnonzero(at == n).tolist()
    # the children the tree counts equal the run keys whose parent is in the run
    return [ups[i] for i in outside] if sum(kids) == n - len(outside) else None
