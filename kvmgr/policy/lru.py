"""Least-recently-used eviction, prefix-consistent.

Offers `LRUPolicy`, registered as ``"lru"``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Sequence

from kvmgr.policy.base import KeyPredicate, _check_capacity, _check_evict_count
from kvmgr.policy.runs import leading_run
from kvmgr.policy.tree import PrefixTree, VictimSet, check_new, check_tracked, first_leaf

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """Evicts the least recently inserted-or-hit evictable leaf of the cached prefix tree.

    Data structures
        One ``OrderedDict[bytes, bytes | None]`` (key -> its parent) from the least (front)
        to the most (back) recently used key, and a `PrefixTree` (tracked-children counts).

    Flow
        ``insert`` and ``touch`` walk their keys in reverse and put each at the MRU end, so
        the first key of a batch (the shortest prefix) ends most recent and a store of one
        chain ``[A, B, C, D]`` is evicted ``D, C, B, A``. ``evict`` offers keys from the LRU
        end to a `VictimSet`: a key with tracked children waits until they are taken (prefix
        consistency), protected and non-evictable keys are skipped; the ``n`` found are
        removed only once all ``n`` were found.

    Complexity
        ``insert``, ``touch``, ``remove``: O(len(keys)), C-level loops (``OrderedDict.update``,
        ``move_to_end`` through ``map``) except the tree's child counts on ``remove``.
        ``evict``: O(n + keys skipped) Python steps. ``__contains__``, ``__len__``: O(1).

    Args:
        capacity: Number of CPU blocks; kept for the shared constructor signature (LRU needs no bound).

    Raises:
        ConfigError: If ``capacity`` is not an ``int`` greater than 0.
    """

    name: str = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity: int = _check_capacity(capacity)
        self._order: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._tree = PrefixTree()

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys, the first most recent. See `EvictionPolicy.insert`.

        Raises:
            BlockStateError: If a key is already tracked or repeated.
            ValueError: If ``len(parents) != len(keys)``.
        """
        check_new(self._order, keys, parents, self.name)
        self.insert_new(keys, parents, childless=False)

    def insert_new(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None], *, childless: bool = True
    ) -> None:
        """`insert` without its checks, for a caller that vouches for the batch: one parent
        per key, the keys distinct and untracked, and (``childless``) none of them the parent
        of a tracked key. The CPU tier knows this from its index and chains (see
        ``EvictionPolicy``); anything else calls `insert`."""
        self._tree.add(keys, parents, childless=childless)
        if len(keys) == 1:
            self._order[keys[0]] = parents[0]
        else:
            self._order.update(zip(reversed(keys), reversed(parents)))

    def touch(self, keys: Sequence[bytes]) -> None:
        """Move the tracked ``keys`` to the MRU end, the first key last; others ignored."""
        order = self._order
        deque(map(order.move_to_end, filter(order.__contains__, reversed(keys))), 0)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking ``keys``.

        Raises:
            UnknownKeyError: If a key is not tracked; nothing changed then.
        """
        unique = list(dict.fromkeys(keys))
        check_tracked(self._order, unique, self.name)
        self._tree.release(map(self._order.pop, unique))

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return the ``n`` least recently used evictable leaves, or ``None``.

        See `EvictionPolicy.evict`; ``None`` means fewer than ``n`` keys qualify and nothing
        changed.

        Raises:
            ValueError: If ``n`` is negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        if n == 1:  # the per-call store
            key = first_leaf(self._tree, self._order, can_evict, protected)
            if key is None:
                return None
            self._tree.release((self._order.pop(key),))
            return [key]
        run = leading_run(self._order, n, self._tree, can_evict, protected)  # array passes
        if run is not None:
            deque(map(self._order.__delitem__, run), 0)
            return run
        victims = VictimSet(self._tree, self._order, n, can_evict, protected)
        if not victims.offer_all(self._order):  # phase 1: collect; the order is not mutated
            victims.rollback()
            return None
        deque(map(self._order.__delitem__, victims.keys), 0)  # phase 2: commit
        return victims.keys

    def ordered_keys(self) -> list[bytes]:
        """Tracked keys from least to most recently used (for tests and reports); O(len)."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __repr__(self) -> str:
        return f"LRUPolicy(capacity={self.capacity}, num_keys={len(self._order)})"
