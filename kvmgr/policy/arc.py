"""Adaptive Replacement Cache (ARC) eviction.

Offers `ARCPolicy`, registered as ``"arc"``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvmgr.policy._arc_lists import collect, commit_one, insert_ghost_hits, leaf_run, trim_ghosts
from kvmgr.policy.base import KeyPredicate, _check_capacity, _check_evict_count
from kvmgr.policy.tree import PrefixTree, check_new, check_tracked, first_leaf

__all__ = ["ARCPolicy"]


class ARCPolicy:
    """ARC: balances recency against frequency and tunes the balance from its own misses.

    Data structures
        Four ``OrderedDict[bytes, None]``, each ordered from LRU (front) to MRU (back):

        - ``T1``: resident keys hit once since they were stored (recency);
        - ``T2``: resident keys hit at least twice, or re-stored soon after eviction
          (frequency);
        - ``B1``/``B2``: ghost keys, recently evicted from ``T1``/``T2``; keys only, no blocks.

        ``target`` (``p`` in the paper) is the adaptive target size of ``T1``, a float in
        ``[0, capacity]``, starting at 0. The ghost lists obey the paper's directory bounds,
        trimmed from their LRU ends: ``|T1| + |B1| <= capacity``, ``|B2| <= capacity`` and
        ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity`` (so ``|B1| + |B2| <= 2 * capacity``
        always, and ``<= capacity`` once the cache is full).

    Flow
        - ``insert(keys, parents)``: walks the batch in reverse (its first key ends most
          recent). A brand-new key goes to the MRU end of ``T1``; a key found in a ghost list
          adapts ``target`` (below), leaves the ghost list and goes to the MRU end of ``T2``.
        - ``touch(keys)``: walks the keys in reverse (the first key ends most recent). A key
          in ``T1`` is promoted to the MRU end of ``T2``; a key in ``T2`` moves to its MRU
          end. Untracked and ghost keys are ignored. Every touch is a use (a lookup hit, a
          load, or a store of a key already resident, i.e. a second computation of it).
        - ``evict(n, ...)``: offers candidates one at a time in ARC order to a prefix-
          consistent `VictimSet` (a key goes only after its tracked children): from the LRU
          end of ``T1`` while ``T1``'s size (less the victims already taken from it) exceeds
          ``target``, otherwise from the LRU end of ``T2``; when the preferred list has no
          evictable key left, from the other. Protected and non-evictable keys are skipped
          and stay where they are. Only when ``n`` victims were found are they removed, each
          appended to the ghost list of its source (``T1`` -> ``B1``, ``T2`` -> ``B2``), and
          the ghost lists trimmed.
        - ``remove(keys)``: untracks the keys without recording ghosts (not an eviction).

    Adaptive behaviour
        A store of a key in ``B1`` means ``T1`` was too small: ``target`` grows by
        ``max(1, |B2| / |B1|)``, capped at ``capacity``. A store of a key in ``B2`` means
        ``T2`` was too small: ``target`` shrinks by ``max(1, |B1| / |B2|)``, floored at 0.
        Both ratios use the list sizes before the key leaves its ghost list. Unlike the
        paper, which adapts before replacing, the manager evicts before it inserts, so the
        adaptation applies from the next eviction on; and the paper's ``|T1| == p`` tie-break
        on a ``B2`` hit is dropped (``evict`` does not see the incoming key).

    Reference
        N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
        USENIX FAST 2003. The reverse-walk ``touch`` follows vLLM's CPU offloading ARC
        policy; its PENDING rule (a PENDING ``T1`` key is not promoted) is dropped because v2
        touches only real uses (docs/policies.md).

    Complexity
        ``insert``, ``touch``, ``remove``: O(len(keys)); ghost trimming removes at most what
        was added. ``evict``: O(n + keys skipped), plus O(len(protected)) when ``protected``
        is not a set; when the first ``n`` keys of the list it starts from are one chain (leaf
        first) or roots, all evictable (the usual full tier), ``_arc_lists.leaf_run`` takes
        them without a `VictimSet` (else ``_arc_lists.collect`` offers them one at a time).
        ``__contains__``, ``__len__``: O(1). The lists are changed in plain loops:
        ``OrderedDict.update(zip(...))`` and ``map(od.__delitem__, ...)`` cost more per key
        than a loop's item assignment, for a few keys as for hundreds.

    Args:
        capacity: Number of CPU blocks: the cap on ``target`` and the ghost bound.

    Raises:
        ConfigError: If ``capacity`` is not an ``int`` greater than 0.
    """

    name: str = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity: int = _check_capacity(capacity)
        self._target: float = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._tree = PrefixTree()
        self._parent_of: dict[bytes, bytes | None] = {}

    # -- protocol ---------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys: into ``T1`` if new, into ``T2`` after adapting if a ghost.

        The batch is walked in reverse, so its first key ends most recent in its list.

        Raises:
            BlockStateError: If a key is already tracked or repeated; nothing changed then.
            ValueError: If ``len(parents) != len(keys)``; nothing changed then.
        """
        parent_of, t1, b1, b2 = self._parent_of, self._t1, self._b1, self._b2
        if (
            len(keys) == 1
            and len(parents) == 1
            and (key := keys[0]) not in parent_of
            and key not in b1
            and key not in b2
        ):  # the per-call store of a new key
            parent = parents[0]
            if parent is not None:
                num_children = self._tree.num_children
                num_children[parent] = num_children.get(parent, 0) + 1
            parent_of[key] = parent
            t1[key] = None
            trim_ghosts(len(t1), len(self._t2), b1, b2, self.capacity)
            return
        check_new(parent_of, keys, parents, self.name)
        self._tree.add(keys, parents)
        for key, parent in zip(keys, parents):  # plain loops: see Complexity
            parent_of[key] = parent
        if b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys):
            for key in reversed(keys):
                t1[key] = None
        else:
            lists = (t1, self._t2, b1, b2)
            self._target = insert_ghost_hits(keys, lists, self._target, self.capacity)
        trim_ghosts(len(t1), len(self._t2), b1, b2, self.capacity)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record hits, first key most recent: ``T1`` keys are promoted to ``T2``'s MRU end,
        ``T2`` keys move to it; untracked and ghost keys are ignored."""
        t1, t2 = self._t1, self._t2
        backwards = list(reversed(dict.fromkeys(keys)))  # a repeated key counts where it is first
        refresh = not t2.keys().isdisjoint(keys)
        promoted = list(filter(t1.__contains__, backwards))
        for key in promoted:
            del t1[key]
            t2[key] = None
        if refresh:  # keys already in T2 join the promoted ones in reverse batch order
            for key in filter(t2.__contains__, backwards):
                t2.move_to_end(key)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking ``keys`` without recording ghost entries.

        Raises:
            UnknownKeyError: If a key is not tracked (ghost keys are not tracked); nothing changed then.
        """
        unique = list(dict.fromkeys(keys))
        check_tracked(self._parent_of, unique, self.name)
        self._tree.release(map(self._parent_of.pop, unique))
        t1, t2 = self._t1, self._t2
        for key in unique:
            if key in t1:
                del t1[key]
            else:
                del t2[key]

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return ``n`` victims in ARC order, or ``None`` with nothing changed.

        See the class docstring for the order and `EvictionPolicy.evict` for the contract.

        Raises:
            ValueError: If ``n`` is negative or not an ``int``.
        """
        if n == 1 and type(n) is int:  # the per-call store: valid, no further check
            return self._evict_one(can_evict, protected)
        _check_evict_count(n)
        if n <= 1:
            return [] if n == 0 else self._evict_one(can_evict, protected)
        t1, target = self._t1, self._target
        taken = None
        if len(t1) - math.floor(target) >= n:  # every victim from T1: maybe its first n keys
            taken = leaf_run(t1, n, self._tree, self._parent_of, can_evict, protected)
        elif len(t1) <= target:  # T2 first: maybe its first n keys
            taken = leaf_run(self._t2, n, self._tree, self._parent_of, can_evict, protected)
        if taken is None:
            lists = (self._t1, self._t2, self._tree, self._parent_of)
            taken = collect(lists, self._target, n, can_evict, protected)
            if taken is None:
                return None
        return self._commit(taken)

    def _commit(self, taken: list[bytes]) -> list[bytes]:
        """Untrack victims (their parents' child counts already released) into the ghost list
        of their source (``T1`` -> ``B1``, ``T2`` -> ``B2``) and restore the ghost bounds."""
        parent_of, t1, t2, b1, b2 = self._parent_of, self._t1, self._t2, self._b1, self._b2
        cap = self.capacity
        if t2.keys().isdisjoint(taken):  # the common case: every victim from T1
            for key in taken:
                del parent_of[key], t1[key]
                b1[key] = None
            if len(t1) + len(b1) <= cap and len(t1) + len(t2) + len(b1) + len(b2) <= 2 * cap:
                return taken  # T1 + B1 and the total did not grow, B2 did not: bounds hold
        else:
            for key in taken:
                del parent_of[key]
                if key in t1:
                    del t1[key]
                    b1[key] = None
                else:
                    del t2[key]
                    b2[key] = None
        trim_ghosts(len(t1), len(t2), b1, b2, cap)
        return taken

    def _evict_one(
        self, can_evict: KeyPredicate, protected: Collection[bytes]
    ) -> list[bytes] | None:
        """``evict(1, ...)`` (the per-call store): the same choice without a `VictimSet`."""
        t1, t2, tree = self._t1, self._t2, self._tree
        first, second = (t1, t2) if len(t1) > self._target else (t2, t1)
        key = next(iter(first), None)
        num_children = tree.num_children
        if key is None or key in num_children or key in protected or not can_evict(key):
            key = first_leaf(tree, first, can_evict, protected)
            if key is None:
                key = first_leaf(tree, second, can_evict, protected)
                if key is None:
                    return None
        lists = (t1, t2, self._b1, self._b2)
        return commit_one(key, self._parent_of.pop(key), num_children, lists, self.capacity)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    # -- introspection (tests, reports) -----------------------------------------------------

    @property
    def target(self) -> float:
        """Adaptive target size of ``T1`` (``p`` in the paper), in blocks."""
        return self._target

    @property
    def t1(self) -> list[bytes]:
        """Resident recency list, LRU first; O(len)."""
        return list(self._t1)

    @property
    def t2(self) -> list[bytes]:
        """Resident frequency list, LRU first; O(len)."""
        return list(self._t2)

    @property
    def b1(self) -> list[bytes]:
        """Ghosts evicted from ``T1``, LRU first; O(len)."""
        return list(self._b1)

    @property
    def b2(self) -> list[bytes]:
        """Ghosts evicted from ``T2``, LRU first; O(len)."""
        return list(self._b2)

    def __repr__(self) -> str:
        return (
            f"ARCPolicy(capacity={self.capacity}, target={self._target:g}, "
            f"t1={len(self._t1)}, t2={len(self._t2)}, b1={len(self._b1)}, b2={len(self._b2)})"
        )
