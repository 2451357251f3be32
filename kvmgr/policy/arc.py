"""Adaptive Replacement Cache (ARC) eviction.

Offers `ARCPolicy`, registered as ``"arc"``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from kvmgr.errors import BlockStateError, UnknownKeyError
from kvmgr.policy.base import KeyPredicate, _as_lookup, _check_capacity, _check_evict_count

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
        - ``insert(key)``: a brand-new key goes to the MRU end of ``T1``; a key found in a
          ghost list adapts ``target`` (below), leaves the ghost list and goes to the MRU end
          of ``T2``.
        - ``touch(keys)``: walks the keys in reverse (the first key ends most recent). A READY
          key in ``T1`` is promoted to the MRU end of ``T2``; a key in ``T1`` that is still
          PENDING (``is_ready(key)`` false) stays in ``T1`` and only moves to its MRU end,
          because queuing its store was not a second use; a key in ``T2`` moves to its MRU
          end. Untracked and ghost keys are ignored.
        - ``evict(n, ...)``: picks victims one at a time in ARC order: from the LRU end of
          ``T1`` while ``T1``'s size (less the victims already taken from it) exceeds
          ``target``, otherwise from the LRU end of ``T2``; when the preferred list has no
          evictable key left, from the other. Protected and non-evictable keys are skipped
          and stay where they are. Only when ``n`` victims were found are they removed, each
          appended to the ghost list of its source (``T1`` -> ``B1``, ``T2`` -> ``B2``), and
          the ghost lists trimmed.
        - ``remove(key)``: untracks the key without recording a ghost (not an eviction).

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
        USENIX FAST 2003. The PENDING rule and the reverse-walk ``touch`` follow vLLM's CPU
        offloading ARC policy.

    Complexity
        ``insert``, ``remove``, ``__contains__``, ``__len__``: O(1) amortized (ghost trimming
        removes at most what was added). ``touch``: O(len(keys)). ``evict``: O(n + keys
        skipped), plus O(len(protected)) when ``protected`` is not already a set.

    Parameters
    ----------
    capacity : int
        Number of CPU blocks: the cap on ``target`` and the ghost bound.

    Raises
    ------
    ConfigError
        If ``capacity`` is not an ``int`` greater than 0.
    """

    name: str = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity: int = _check_capacity(capacity)
        self._target: float = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    # -- protocol ---------------------------------------------------------------------------

    def insert(self, key: bytes) -> None:
        """Track ``key``: into ``T1`` if new, into ``T2`` after adapting if it is a ghost.

        Raises
        ------
        BlockStateError
            If ``key`` is already tracked.
        """
        if key in self._t1 or key in self._t2:
            raise BlockStateError(f"key {key!r} is already tracked by the {self.name} policy")
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self._target = min(self._target + delta, float(self.capacity))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self._target = max(self._target - delta, 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, keys: Sequence[bytes], is_ready: KeyPredicate | None = None) -> None:
        """Record hits, first key most recent; PENDING keys (``is_ready`` false) stay in T1.

        Parameters
        ----------
        keys : Sequence[bytes]
            Hit keys in prefix order; untracked ones are ignored.
        is_ready : KeyPredicate or None
            Whether a key's store has completed; ``None`` treats every key as READY.
        """
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t1:
                if is_ready is None or is_ready(key):
                    del t1[key]
                    t2[key] = None
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def remove(self, key: bytes) -> None:
        """Stop tracking ``key`` without recording a ghost entry.

        Raises
        ------
        UnknownKeyError
            If ``key`` is not tracked (ghost keys are not tracked).
        """
        if key in self._t1:
            del self._t1[key]
        elif key in self._t2:
            del self._t2[key]
        else:
            raise UnknownKeyError(f"key {key!r} is not tracked by the {self.name} policy")

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return ``n`` victims in ARC order, or ``None`` with nothing changed.

        See the class docstring for the order and `EvictionPolicy.evict` for the contract.

        Raises
        ------
        ValueError
            If ``n`` is negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        protected = _as_lookup(protected)
        # Phase 1: collect without mutating. Each list is scanned once from its LRU end, so
        # skipped keys are visited at most once per call.
        scans = {True: iter(self._t1), False: iter(self._t2)}
        virtual_t1_size = len(self._t1)
        victims: list[tuple[bytes, bool]] = []  # (key, taken from T1)
        while len(victims) < n:
            prefer_t1 = virtual_t1_size > self._target
            for from_t1 in (prefer_t1, not prefer_t1):
                key = _next_evictable(scans[from_t1], can_evict, protected)
                if key is not None:
                    break
            else:
                return None  # fewer than n evictable keys in T1 and T2 together
            victims.append((key, from_t1))
            if from_t1:
                virtual_t1_size -= 1
        # Phase 2: commit all of them.
        for key, from_t1 in victims:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        self._trim_ghosts()
        return [key for key, _ in victims]

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

    # -- private ----------------------------------------------------------------------------

    def _trim_ghosts(self) -> None:
        """Enforce the ghost bounds of the class docstring by dropping LRU ghosts."""
        cap = self.capacity
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        while b1 and len(t1) + len(b1) > cap:
            b1.popitem(last=False)
        while len(b2) > cap:
            b2.popitem(last=False)
        excess = len(t1) + len(t2) + len(b1) + len(b2) - 2 * cap
        for ghosts in (b2, b1):
            while excess > 0 and ghosts:
                ghosts.popitem(last=False)
                excess -= 1


def _next_evictable(
    scan: Iterator[bytes], can_evict: KeyPredicate, protected: Collection[bytes]
) -> bytes | None:
    """Advance ``scan`` to the next unprotected key that ``can_evict`` accepts; ``None`` at end."""
    for key in scan:
        if key not in protected and can_evict(key):
            return key
    return None
