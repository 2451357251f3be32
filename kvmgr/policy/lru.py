"""Least-recently-used eviction.

Offers `LRUPolicy`, registered as ``"lru"``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvmgr.errors import BlockStateError, UnknownKeyError
from kvmgr.policy.base import KeyPredicate, _as_lookup, _check_capacity, _check_evict_count

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """Evicts the least recently inserted-or-hit evictable key first.

    Data structures
        One ``OrderedDict[bytes, None]`` from the least (front) to the most (back) recently
        used key. PENDING and READY keys share it; the manager's ``can_evict`` skips the ones
        it may not evict.

    Flow
        ``insert`` appends at the MRU end; ``touch`` walks its keys in reverse and moves each
        tracked one to the MRU end, so the first key ends most recent; ``evict`` scans from
        the LRU end, skipping protected and non-evictable keys, and removes the ``n`` found
        only once all ``n`` were found.

    Complexity
        ``insert``, ``remove``, ``__contains__``, ``__len__``: O(1).
        ``touch``: O(len(keys)). ``evict``: O(n + keys skipped), plus O(len(protected)) when
        ``protected`` is not already a set.

    Parameters
    ----------
    capacity : int
        Number of CPU blocks; kept for the shared constructor signature (LRU needs no bound).

    Raises
    ------
    ConfigError
        If ``capacity`` is not an ``int`` greater than 0.
    """

    name: str = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity: int = _check_capacity(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        """Track ``key`` as the most recently used.

        Raises
        ------
        BlockStateError
            If ``key`` is already tracked.
        """
        if key in self._order:
            raise BlockStateError(f"key {key!r} is already tracked by the {self.name} policy")
        self._order[key] = None

    def touch(self, keys: Sequence[bytes], is_ready: KeyPredicate | None = None) -> None:
        """Move the tracked ``keys`` to the MRU end, the first key last; ``is_ready`` unused."""
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        """Stop tracking ``key``.

        Raises
        ------
        UnknownKeyError
            If ``key`` is not tracked.
        """
        if key not in self._order:
            raise UnknownKeyError(f"key {key!r} is not tracked by the {self.name} policy")
        del self._order[key]

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return the ``n`` least recently used evictable keys, or ``None``.

        See `EvictionPolicy.evict`; ``None`` means fewer than ``n`` keys qualify and nothing
        changed.

        Raises
        ------
        ValueError
            If ``n`` is negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        protected = _as_lookup(protected)
        victims: list[bytes] = []
        for key in self._order:  # phase 1: collect from the LRU end, no mutation
            if key not in protected and can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:  # phase 2: commit
            del self._order[key]
        return victims

    def ordered_keys(self) -> list[bytes]:
        """Tracked keys from least to most recently used (for tests and reports); O(len)."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __repr__(self) -> str:
        return f"LRUPolicy(capacity={self.capacity}, num_keys={len(self._order)})"
