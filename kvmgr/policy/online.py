"""Online admission over LRU, guarded by sampled shadow caches (set dueling).

Offers `OnlinePolicy`, registered as ``"online"``.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvmgr.policy._online_cells import CONTINUE_S, CellRates, Chain, cell_of
from kvmgr.policy._online_hints import HintState
from kvmgr.policy._set_dueling import SetDueling
from kvmgr.policy.base import KeyPredicate, _check_capacity
from kvmgr.policy.hints import StoreHint
from kvmgr.policy.tracked import TrackedPolicy, chain_spans
from kvmgr.policy.tree import PrefixTree, VictimSet

__all__ = ["OnlinePolicy"]


class OnlinePolicy(TrackedPolicy):
    """LRU eviction with admission learned from the stream, never much worse than LRU.

    Admission
        Each store is split into chains (runs of keys extending each other). A chain's *cell*
        is (first key a ghost hit: evicted or declined before / first seen; its parent
        tracked / a ghost / unknown; times the parent was extended: 1, 2, 3-8, more;
        floor(log2 blocks); the hint: none, continue, not). Per cell the policy learns the
        fraction of chains *reused within reach* (touched, extended, or stored again; a chain
        evicted unused, or declined and not seen again within the LRU's eviction age, is not),
        shrunk to its coarse cell (ghost x parent x hint) and that to the overall rate with
        8 pseudo-outcomes. A chain is admitted while its rate is at least the current
        threshold (or while the tier is not full); a declined chain's keys join the ghost, so
        its next store is a second access.
    Guard (set dueling, Qureshi et al. ISCA'07)
        A fixed 1/2^k sample of keys (by a key byte; the shadows hold >= 1024 keys) feeds one
        shadow LRU per threshold in ``THRESHOLDS`` (0 is plain LRU), each of capacity/2^k; the
        shadows count decayed hits on the same stream and the tier uses the threshold of the
        best shadow (switching on a 2% lead). So the policy follows LRU wherever declining
        does not pay (large tiers, an unfamiliar workload); no setting is tuned per trace.
    Hints (`StoreHint`)
        ``continue_p`` is a feature (learned, so a noisy hint costs little); ``priority > 0``
        always admits, ``< 0`` declines while full; ``ttl_s`` makes the chain a first victim
        after it; ``session`` counts a session's next store as a reuse of its last chain.

    Complexity
        ``admit``/``insert``/``touch``: O(len(keys)) C-level dict work plus O(chains) Python
        steps plus O(sampled keys x shadows); ``evict``: O(n + skipped) like LRU.

    Args:
        capacity: CPU blocks.
        clock: seconds, monotonic (the simulator passes its virtual clock).

    Raises:
        ConfigError: ``capacity`` not an ``int`` > 0.
    """

    name: str = "online"
    takes_hints: bool = True

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = _check_capacity(capacity)
        self._clock = clock
        # tracked key -> parent, least recently used first
        self._tracked: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._tree = PrefixTree()
        self._chain: dict[bytes, Chain] = {}  # tracked and ghost keys -> their chain
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._kids: dict[bytes, int] = {}  # parent key -> chains stored extending it
        self._rates = CellRates()
        self._declined: deque[Chain] = deque()
        self._hints = HintState(capacity)
        self._guard = SetDueling(capacity)
        self.reach_s = float("inf")  # EWMA of the eviction age (now - last use of victims)
        self.num_declined = 0

    @property
    def threshold(self) -> float:
        """The admission threshold in use, the best shadow's (one of ``THRESHOLDS``)."""
        return self._guard.threshold

    # ------------------------------------------------------------------ protocol

    def admit(
        self,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None],
        hints: Sequence[StoreHint | None] | None = None,
    ) -> np.ndarray:
        """Which keys to store (``bool [len(keys)]``), closed under parents; learns from them.

        Args:
            keys, parents: as `EvictionPolicy.insert`.
            hints: one `StoreHint` or ``None`` per key (the first key's hint is its chain's).

        Raises:
            ValueError: ``len(parents)`` or ``len(hints)`` differs from ``len(keys)``.
        """
        n = len(keys)
        if len(parents) != n or (hints is not None and len(hints) != n):
            raise ValueError(f"expected one parent (and hint) per key, got {len(parents)} for {n}")
        mask = np.ones(n, dtype=bool)
        if n == 0:
            return mask
        now = self._clock()
        self._expire(now)
        full = len(self._tracked) + n > self.capacity
        declined: set[bytes] = set()
        for s, e in chain_spans(keys, parents):
            parent = parents[s]
            up = None if parent is None else self._chain.get(parent)
            if up is not None and self._same_prefill(up, parent, now):
                self._grow(up, list(keys[s:e]), parent in declined, now)
                take = up.admitted and parent not in declined
            else:
                hint = None if hints is None else hints[s]
                chunk = list(keys[s:e])
                take = self._admit_chain(chunk, parent, hint, full, parent in declined, now)
            if not take:
                mask[s:e] = False
                declined.update(keys[s:e])
        self._trim_ghost()
        return mask

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track stored keys, the first most recent (see `EvictionPolicy.insert`).

        Raises:
            BlockStateError: a key is tracked already or repeated.
            ValueError: ``len(parents) != len(keys)``.
        """
        self._check_new(keys, parents)
        self._tracked.update(zip(reversed(keys), reversed(parents)))
        ghost = self._ghost
        if not ghost.keys().isdisjoint(keys):
            for key in keys:
                ghost.pop(key, None)
        if not self._chain.keys() >= set(keys):  # stored without admit (a direct caller)
            now = self._clock()
            chain = Chain(0, now, True)
            chain.open = False
            for key in keys:
                self._chain.setdefault(key, chain)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Hits, in prefix order (first = most recent); they are reuse outcomes of their chains."""
        order = self._tracked
        hit = [k for k in reversed(keys) if k in order]
        deque(map(order.move_to_end, hit), 0)
        if not hit:
            return
        now = self._clock()
        for chain in {id(c): c for c in map(self._chain.get, hit) if c is not None}.values():
            self._rates.outcome(chain, True)
            chain.last = now
        self._guard.feed(hit[::-1], 1.0)

    def _forget(self, keys: list[bytes]) -> None:
        super()._forget(keys)
        for key in keys:
            self._chain.pop(key, None)

    def _evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes]
    ) -> list[bytes] | None:
        """Expired TTLs first, then least recently used (chains with a reprieve left last)."""
        order = self._tracked
        victims = VictimSet(self._tree, order, n, can_evict, protected)
        now = self._clock()
        spared = self._hints.offer(victims, order, self._chain, now)
        if spared is None:
            victims.rollback()
            return None
        keys = victims.keys
        self._hints.use_reprieves(spared, order)
        deque(map(order.__delitem__, keys), 0)
        self._ghost.update(dict.fromkeys(keys))
        for chain in dict.fromkeys(map(self._chain.get, keys)):
            if chain is not None:
                self._rates.outcome(chain, False)
                age = now - chain.last
                self.reach_s = (
                    age if self.reach_s == float("inf") else 0.99 * self.reach_s + 0.01 * age
                )
        self._trim_ghost()
        return keys

    # ------------------------------------------------------------------ helpers

    def _admit_chain(
        self,
        chunk: list[bytes],
        parent: bytes | None,
        hint: StoreHint | None,
        full: bool,
        parent_declined: bool,
        now: float,
    ) -> bool:
        """Decide on a new chain (not the next chunk of a prefill) and learn from it; return
        whether it is admitted. A declined chain's keys join the ghost."""
        first = chunk[0]
        cell, turn, end = cell_of(
            first, parent, len(chunk), hint, now,
            ghost=self._ghost, tracked=self._tracked, chain_of=self._chain, kids=self._kids,
        )  # fmt: skip
        self._evidence(first, parent, hint, now)
        if parent is not None:
            self._kids[parent] = self._kids.get(parent, 0) + 1
        p = self._rates.rate(cell)
        self._guard.feed(chunk, p)
        take = p >= self._guard.threshold or not full
        if hint is not None and hint.priority:
            take = hint.priority > 0 or not full
        if parent_declined:
            take = False
        chain = Chain(cell, now, take, turn, end)
        chain.keys, chain.p = chunk, p
        self._chain.update(dict.fromkeys(chunk, chain))
        if hint is not None:
            self._hints.admitted(chain, hint, take, now)
        if not take:
            self._declined.append(chain)
            self._ghost.update(dict.fromkeys(chunk))
            self.num_declined += len(chunk)
        return take

    def _same_prefill(self, up: Chain, parent: bytes | None, now: float) -> bool:
        """A chunked prefill stores one prompt over several steps: a chain at the tip of a
        chain grown within ``CONTINUE_S`` and never extended is its next chunk, not a turn."""
        return (
            now - up.grown <= CONTINUE_S
            and bool(up.keys)
            and up.keys[-1] == parent
            and parent not in self._kids
        )

    def _grow(self, up: Chain, chunk: list[bytes], parent_declined: bool, now: float) -> None:
        """Append the next chunk of a prefill to its chain (same decision, no new outcome)."""
        up.keys.extend(chunk)
        up.end += len(chunk)
        up.grown = now
        self._chain.update(dict.fromkeys(chunk, up))
        self._guard.feed(chunk, up.p)
        if not up.admitted or parent_declined:
            self._ghost.update(dict.fromkeys(chunk))
            self.num_declined += len(chunk)
        elif up.expires is not None:
            self._hints.expiry.append((up.expires, chunk))

    def _evidence(
        self, first: bytes, parent: bytes | None, hint: StoreHint | None, now: float
    ) -> None:
        """Outcomes a store reveals: its parent's chain extended, a ghost stored again."""
        chain = None if parent is None else self._chain.get(parent)
        if chain is not None:
            self._rates.outcome(chain, True)
            chain.last = now
        chain = self._chain.get(first) if first in self._ghost else None
        if chain is not None:
            self._rates.outcome(chain, now - chain.last <= self.reach_s)
        if hint is not None and hint.session is not None:
            chain = self._hints.sessions.get(hint.session)
            if chain is not None:
                self._rates.outcome(chain, now - chain.last <= self.reach_s)

    def _expire(self, now: float) -> None:
        declined, reach = self._declined, self.reach_s
        while declined and declined[0].last + reach < now:
            self._rates.outcome(declined.popleft(), False)
        self._hints.forget_gone(self._tracked)

    def _trim_ghost(self) -> None:
        ghost, chain, order = self._ghost, self._chain, self._tracked
        excess = len(ghost) - 2 * self.capacity
        if excess > 0:
            old = list(itertools.islice(ghost, excess))
            deque(map(ghost.__delitem__, old), 0)
            gone = [k for k in old if k not in order]
            deque(map(chain.pop, gone, itertools.repeat(None)), 0)
        if len(self._kids) > 8 * self.capacity:
            self._kids.clear()

    def __repr__(self) -> str:
        return f"OnlinePolicy(capacity={self.capacity}, num_keys={len(self._tracked)}, threshold={self.threshold})"
