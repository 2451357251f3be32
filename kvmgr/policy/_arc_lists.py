"""ARC's list work outside its choice of list: a ghost hit, the ghost bounds, a leaf run.

Private to ``kvmgr.policy`` (`kvmgr.policy.arc.ARCPolicy`; its docstring states the rules).

Offers:
    insert_ghost_hits   a stored batch that holds ghost keys: adapt the target, key by key
    trim_ghosts         enforce the directory bounds by dropping LRU ghosts
    commit_one          untrack one victim into its ghost list (``evict(1)``)
    leaf_run            the first ``n`` keys of a list, when they are one chain or roots and
                        one-offer-at-a-time collection would take exactly those (the common
                        eviction), with C-level passes
    collect             the victims offered one at a time in ARC order (when no leaf run is)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import islice

from kvmgr.policy.base import KeyPredicate, _as_lookup
from kvmgr.policy.tree import PrefixTree, VictimSet

__all__ = ["collect", "commit_one", "insert_ghost_hits", "leaf_run", "trim_ghosts"]

Keys = OrderedDict[bytes, None]


def insert_ghost_hits(
    keys: Sequence[bytes], lists: tuple[Keys, Keys, Keys, Keys], target: float, capacity: int
) -> float:
    """Insert new ``keys`` (some in a ghost list), last key first; return the new target.

    ``lists`` is ``(T1, T2, B1, B2)``. A key in ``B1`` grows the target by
    ``max(1, |B2| / |B1|)`` (capped at ``capacity``), one in ``B2`` shrinks it by
    ``max(1, |B1| / |B2|)`` (floored at 0), each with the sizes before the key leaves its
    ghost list, and goes to ``T2``'s MRU end; any other key to ``T1``'s.
    """
    t1, t2, b1, b2 = lists
    for key in reversed(keys):
        if key in b1:
            target = min(target + max(1.0, len(b2) / len(b1)), float(capacity))
            del b1[key]
            t2[key] = None
        elif key in b2:
            target = max(target - max(1.0, len(b1) / len(b2)), 0.0)
            del b2[key]
            t2[key] = None
        else:
            t1[key] = None
    return target


def trim_ghosts(size_t1: int, size_t2: int, b1: Keys, b2: Keys, capacity: int) -> None:
    """Drop LRU ghosts until ``|T1| + |B1| <= capacity``, ``|B2| <= capacity`` and
    ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity`` (as far as ghosts can be dropped)."""
    size_b1, size_b2 = len(b1), len(b2)
    over = size_t1 + size_b1 - capacity
    if over <= 0 and size_b2 <= capacity and over + size_t2 + size_b2 <= capacity:
        return  # every bound holds (the common store): nothing to drop
    if over > 0 and size_b1:
        if over == 1:
            b1.popitem(last=False)
        else:
            _drop_oldest(b1, over)
        size_b1 = len(b1)
    if size_b2 > capacity:
        _drop_oldest(b2, size_b2 - capacity)
        size_b2 = capacity
    excess = size_t1 + size_t2 + size_b1 + size_b2 - 2 * capacity
    if excess > 0 and size_b2:
        excess -= _drop_oldest(b2, excess)
    if excess > 0 and b1:
        _drop_oldest(b1, excess)


def commit_one(
    key: bytes,
    parent: bytes | None,
    num_children: dict[bytes, int],
    lists: tuple[Keys, Keys, Keys, Keys],
    capacity: int,
) -> list[bytes]:
    """Untrack the victim ``key`` (already out of ``parent_of``; ``parent``: its parent, whose
    child count in ``num_children`` drops by one) into the ghost list of its source (``T1`` ->
    ``B1``, ``T2`` -> ``B2``) and restore the ghost bounds; ``[key]``. ``lists`` is
    ``(T1, T2, B1, B2)``."""
    if parent is not None:  # `PrefixTree.release` of one parent
        count = num_children[parent]
        if count == 1:
            del num_children[parent]
        else:
            num_children[parent] = count - 1
    t1, t2, b1, b2 = lists
    if key in t1:
        del t1[key]
        b1[key] = None
        if len(t1) + len(b1) <= capacity and len(t1) + len(t2) + len(b1) + len(b2) <= 2 * capacity:
            return [key]  # T1 + B1 and the total did not grow, B2 did not: bounds hold
    else:
        del t2[key]
        b2[key] = None
    trim_ghosts(len(t1), len(t2), b1, b2, capacity)
    return [key]


def _drop_oldest(ghosts: Keys, count: int) -> int:
    """Drop up to ``count`` keys from the LRU end of ``ghosts``; return how many were dropped."""
    oldest = list(islice(ghosts, count))
    for key in oldest:  # a loop: map(__delitem__) costs more per key (ARCPolicy, Complexity)
        del ghosts[key]
    return len(oldest)


def leaf_run(
    order: Keys,
    n: int,
    tree: PrefixTree,
    parent_of: dict[bytes, bytes | None],
    can_evict: KeyPredicate,
    protected: Collection[bytes],
) -> list[bytes] | None:
    """The first ``n`` keys of ``order`` with the tree's child counts released for them, when
    they are one chain (each key's parent the next key, its leaf first) or roots, and
    `VictimSet.offer_all` over ``order`` would take exactly those; else ``None``, nothing
    changed (the caller collects one offer at a time).

    It would when each is unprotected and evictable and has no tracked child but the key
    before it in a chain: then none waits. ``can_evict`` is asked once per key, in order,
    through a C-level ``map`` (for a few keys cheaper than a numpy pass)."""
    run = list(islice(order, n))
    num_children = tree.num_children
    if len(run) < n or run[0] in num_children:  # the first key waits for a child: no run
        return None
    if protected and not _as_lookup(protected).isdisjoint(run):  # type: ignore[attr-defined]
        return None
    ups = list(map(parent_of.__getitem__, run))
    if ups[:-1] == run[1:]:  # one chain
        kids = list(map(num_children.get, islice(run, 1, None)))
        if kids.count(1) != n - 1 or not all(map(can_evict, run)):
            return None
        for key in islice(run, 1, None):
            del num_children[key]
        tree.release((ups[-1],))  # the parent outside the run loses one child
        return run
    if ups.count(None) == n and num_children.keys().isdisjoint(run) and all(map(can_evict, run)):
        return run  # roots without children
    return None


def collect(
    lists: tuple[Keys, Keys, PrefixTree, dict[bytes, bytes | None]],
    target: float,
    n: int,
    can_evict: KeyPredicate,
    protected: Collection[bytes],
) -> list[bytes] | None:
    """The ``n`` victims of `ARCPolicy.evict` offered one at a time in ARC order, the tree's
    counts released for them; ``None`` (counts restored) when there are fewer. ``lists`` is
    ``(T1, T2, tree, parent_of)``, ``target`` ARC's target size of ``T1``.

    Each list is scanned once from its LRU end, so skipped keys are visited at most once.
    T1 is preferred while its size less the T1 keys taken exceeds ``target``: a T1 run may
    take ``quota`` keys before the preference can flip (a victim of the run may be a
    released T2 ancestor, so the size is recounted after it). The size only shrinks, so
    once T2 is preferred it stays so.
    """
    t1, t2, tree, parent_of = lists
    victims = VictimSet(tree, parent_of, n, can_evict, protected)
    scan_t1, scan_t2 = iter(t1), iter(t2)
    taken = victims.keys
    virtual_t1_size = len(t1)
    t1_left = True
    while virtual_t1_size > target and t1_left:
        before = len(taken)
        quota = virtual_t1_size - math.floor(target)
        t1_left = victims.offer_all(scan_t1, stop=min(n, before + quota))
        virtual_t1_size -= sum(map(t1.__contains__, taken[before:]))
        if len(taken) >= n:
            return taken
    if not victims.offer_all(scan_t2) and not (t1_left and victims.offer_all(scan_t1)):
        victims.rollback()
        return None  # fewer than n evictable keys in T1 and T2 together
    return taken
