"""The frame every prefix-consistent policy shares: tracked keys, their tree, the protocol's checks.

Offers `TrackedPolicy`, a base class holding what `EvictionPolicy` asks of every policy and
is not the policy's own rule: ``len``/``in`` over the tracked keys, ``remove``'s checks and
its release of the `PrefixTree`'s child counts, ``insert``'s checks, and ``evict``'s frame
(count check, the empty request) around the policy's choice of victims, ``_evict``; and
`chain_spans`, a batch split into chains (the unit the learned policies admit and learn on).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import cast

from kvmgr.policy.base import KeyPredicate, _check_evict_count
from kvmgr.policy.tree import PrefixTree, check_new, check_tracked

__all__ = ["TrackedPolicy", "chain_spans"]


class TrackedPolicy:
    """Base of a policy whose tracked keys are ``_tracked`` and whose tree is ``_tree``.

    A subclass sets ``name``, ``capacity``, ``_tree`` and ``_tracked``: a mapping or set whose
    members are exactly the tracked (resident) keys; for the default `_forget`, a mapping key
    -> parent. It implements `_evict` and ``insert``/``touch`` (``insert`` starts with
    `_check_new`), and extends `_forget` when it keeps more per key.
    """

    name: str
    capacity: int
    _tracked: Collection[bytes]
    _tree: PrefixTree

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking ``keys`` (a key listed twice counts once).

        Raises:
            UnknownKeyError: If a key is not tracked; nothing changed then.
        """
        unique = list(dict.fromkeys(keys))
        check_tracked(self._tracked, unique, self.name)
        self._forget(unique)

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return ``n`` victims in the policy's order (see `EvictionPolicy.evict`),
        or ``None``: fewer than ``n`` keys qualify, and nothing changed.

        Raises:
            ValueError: If ``n`` is negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        return self._evict(n, can_evict, protected)

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, key: object) -> bool:
        return key in self._tracked

    # -- for subclasses ---------------------------------------------------------------------

    def _check_new(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Validate an ``insert`` batch, then count it into the tree (see `check_new`).

        Raises:
            ValueError: If ``len(parents) != len(keys)``; nothing changed then.
            BlockStateError: If a key is tracked already or repeated; nothing changed then.
        """
        check_new(self._tracked, keys, parents, self.name)
        self._tree.add(keys, parents)

    def _forget(self, keys: list[bytes]) -> None:
        """Untrack distinct tracked ``keys``: pop them from ``_tracked`` (key -> parent) and
        release their parents' child counts."""
        parent_of = cast("dict[bytes, bytes | None]", self._tracked)
        self._tree.release(map(parent_of.pop, keys))

    def _evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes]
    ) -> list[bytes] | None:
        """Choose, untrack and return ``n >= 1`` victims, or ``None`` with nothing changed."""
        raise NotImplementedError


def chain_spans(keys: Sequence[bytes], parents: Sequence[bytes | None]) -> list[tuple[int, int]]:
    """``[start, end)`` of the maximal runs of a batch where each key extends the previous
    one (``parents[i] == keys[i - 1]``), in batch order; ``[]`` for an empty batch."""
    n = len(keys)
    if n == 0:
        return []
    if list(parents[1:]) == list(keys[:-1]):
        return [(0, n)]
    cuts = [i for i in range(1, n) if parents[i] != keys[i - 1]]
    return list(itertools.pairwise([0, *cuts, n]))
