"""Prefix-consistent victim selection, shared by every policy.

Offers:

- `PrefixTree`: per key, the number of tracked children (keys that extend it).
- `first_leaf`: the one-victim case of `VictimSet` (the per-call store), without its set-up.
- `VictimSet`: collects victims from candidates offered in a policy's own preference order so
  that the result is closed under "tracked children" (a key goes only with all its tracked
  children, which go first), and undoes its bookkeeping when the collection fails.

A lookup counts only the leading run of cached keys, so a resident child whose parent was
evicted is dead weight. Policies offer candidates in their order; a candidate with a tracked
child that is not yet a victim waits, and is taken the moment its last child is taken (it was
offered earlier, so it precedes everything not yet offered). A key whose child is pinned,
PENDING or protected therefore stays. Each policy stores the parent of every tracked key
itself (as the value of its ordering dict) and hands `VictimSet` the mapping.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

from kvmgr.errors import BlockStateError, UnknownKeyError
from kvmgr.policy.base import KeyPredicate, _as_lookup

__all__ = ["PrefixTree", "VictimSet", "check_new", "check_tracked", "first_leaf"]


def check_new(
    tracked: Collection[bytes], keys: Sequence[bytes], parents: Sequence[bytes | None], name: str
) -> None:
    """Validate an ``insert`` batch without changing anything.

    Raises:
        ValueError: If ``len(parents) != len(keys)``.
        BlockStateError: If a key is tracked already or repeated in ``keys``.
    """
    n = len(keys)
    if len(parents) != n:
        raise ValueError(f"expected one parent per key, got {len(parents)} for {n}")
    if n == 1:  # the per-call store: one membership test
        if keys[0] not in tracked:
            return
    else:
        if isinstance(tracked, (dict, Mapping)):  # dict first: no ABC check for dicts
            disjoint = tracked.keys().isdisjoint(keys)
        else:
            disjoint = not any(map(tracked.__contains__, keys))
        if disjoint and len(set(keys)) == n:
            return
    seen: set[bytes] = set()
    for key in keys:
        if key in tracked or key in seen:
            raise BlockStateError(f"key {key!r} is already tracked by the {name} policy")
        seen.add(key)


def check_tracked(tracked: Collection[bytes], keys: Iterable[bytes], name: str) -> None:
    """Raise ``UnknownKeyError`` naming the first key of ``keys`` that is not tracked."""
    for key in keys:
        if key not in tracked:
            raise UnknownKeyError(f"key {key!r} is not tracked by the {name} policy")


def first_leaf(
    tree: PrefixTree, keys: Iterable[bytes], can_evict: KeyPredicate, protected: Collection[bytes]
) -> bytes | None:
    """The first of ``keys`` that a one-victim `VictimSet` would take: not protected,
    evictable, and without tracked children (a waiting key is never released when only one
    victim is taken). Changes nothing (the caller untracks the key and releases its parent).
    """
    num_children = tree.num_children
    if not protected:
        for key in keys:
            if key not in num_children and can_evict(key):
                return key
        return None
    if len(protected) > 8:  # a few keys (the per-call store's) are searched without a set
        protected = _as_lookup(protected)
    for key in keys:
        if key not in num_children and key not in protected and can_evict(key):
            return key
    return None


class ParentLookup(Protocol):
    """Anything that maps a tracked key to its parent (a dict, or a policy's own view)."""

    def __getitem__(self, key: bytes, /) -> bytes | None: ...


class PrefixTree:
    """Number of tracked children of every key (only counts > 0 are stored).

    The key itself may be untracked (its children stay tracked after a ``remove`` of it).

    Complexity
        ``add``: O(len(keys)), C-level dict work for one chain of new keys (the common
        store) and a ``Counter`` otherwise. ``release``: O(len(parents)) Python steps.
    """

    def __init__(self) -> None:
        self.num_children: dict[bytes, int] = {}

    def add(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None], *, childless: bool = False
    ) -> None:
        """Count the new keys ``keys`` (validated by `check_new`) as children of ``parents``.

        ``childless``: the caller knows that no key of ``keys`` has a count yet (no tracked
        child), so a chain is counted without looking its keys up first.
        """
        if not keys:
            return
        num_children = self.num_children
        if len(keys) == 1:  # one new key: one more child of its parent, if any
            first = parents[0]
            if first is not None:
                num_children[first] = num_children.get(first, 0) + 1
            return
        if parents[1:] == keys[:-1] and (childless or num_children.keys().isdisjoint(keys)):
            for key in keys[:-1]:  # one chain (a loop: cheaper than update(zip(...)))
                num_children[key] = 1
            first = parents[0]
            if first is not None:
                num_children[first] = num_children.get(first, 0) + 1
            return
        counts = Counter(parents)
        counts.pop(None, None)
        if num_children.keys().isdisjoint(counts):
            num_children.update(counts)  # type: ignore[arg-type]
        else:
            for key, count in counts.items():
                num_children[key] = num_children.get(key, 0) + count  # type: ignore[index, arg-type]

    def release(self, parents: Iterable[bytes | None]) -> None:
        """Uncount one child of each parent (the parents of keys that stopped being tracked)."""
        num_children = self.num_children
        for up in parents:
            if up is not None:
                count = num_children[up]
                if count == 1:
                    del num_children[up]
                else:
                    num_children[up] = count - 1


class VictimSet:
    """Victims collected in offer order, closed under tracked children.

    While collecting, the tree's child counts are updated as if the victims were gone (so a
    parent whose last child was taken is a leaf); `rollback` restores them when the caller
    gives up, `keys` is the list of victims otherwise (the tree is then already committed).

    Args:
        tree: The policy's tree.
        parent_of: Parent of every tracked key (``parent_of[key]``).
        limit: Stop taking keys once this many were taken.
        can_evict: The manager's test; asked at most once per offered key.
        protected: Keys never taken (not even asked about).
    """

    def __init__(
        self,
        tree: PrefixTree,
        parent_of: ParentLookup,
        limit: int,
        can_evict: KeyPredicate,
        protected: Collection[bytes],
    ) -> None:
        self.keys: list[bytes] = []
        self._num_children = tree.num_children
        self._parent_of = parent_of
        self._limit = limit
        self._can_evict = can_evict
        self._protected = _as_lookup(protected)
        self._released: list[bytes] = []
        self._waiting: set[bytes] = set()

    @property
    def is_full(self) -> bool:
        """Whether ``limit`` keys were taken."""
        return len(self.keys) >= self._limit

    def offer(self, key: bytes) -> int:
        """Consider a tracked key (each at most once); return how many keys were taken.

        A key with tracked children not taken yet waits; it is taken right after its last
        child, if that child is taken later in the same collection.
        """
        if key in self._protected or not self._can_evict(key):
            return 0
        if key in self._num_children:
            self._waiting.add(key)
            return 0
        return self._take(key)

    def offer_all(self, keys: Iterable[bytes], stop: int | None = None) -> bool:
        """Offer keys in order until ``limit`` are taken; return whether it was reached.

        ``stop`` (``<= limit``): return ``True`` as soon as ``stop`` keys were taken in all
        (checked between offers; a waiting ancestor released by an offer is still taken up
        to ``limit``), leaving the rest of ``keys`` unread, so that a caller can offer one
        iterator in several runs and look at the victims between them (ARC's list choice).
        """
        protected, can_evict, num_children = self._protected, self._can_evict, self._num_children
        victims, limit, waiting = self.keys, self._limit, self._waiting
        end = limit if stop is None else stop
        parent_of, released = self._parent_of, self._released
        for key in keys:
            if key in protected or not can_evict(key):
                continue
            if key in num_children:
                waiting.add(key)
                continue
            victims.append(key)
            up = parent_of[key]
            if up is not None:
                count = num_children[up]
                released.append(up)
                if count > 1:
                    num_children[up] = count - 1
                else:
                    del num_children[up]
                    if waiting and up in waiting and len(victims) < limit:
                        waiting.discard(up)
                        self._take(up)
            if len(victims) >= end:
                return True
        return False

    def rollback(self) -> None:
        """Restore the tree's child counts changed by this collection."""
        num_children = self._num_children
        for up in self._released:
            num_children[up] = num_children.get(up, 0) + 1
        self._released.clear()

    def _take(self, key: bytes) -> int:
        """Take a leaf and every waiting ancestor it releases, up to ``limit``."""
        taken, victims, num_children = 0, self.keys, self._num_children
        while True:
            victims.append(key)
            taken += 1
            up = self._parent_of[key]
            if up is None:
                return taken
            count = num_children[up]
            self._released.append(up)
            if count > 1:
                num_children[up] = count - 1
                return taken
            del num_children[up]
            if up not in self._waiting or len(victims) >= self._limit:
                return taken
            self._waiting.discard(up)
            key = up
