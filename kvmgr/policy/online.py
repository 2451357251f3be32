"""Online admission over LRU, guarded by sampled shadow caches (set dueling).

Offers `OnlinePolicy`, registered as ``"online"``.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Sequence

import numpy as np

from kvmgr.policy.base import KeyPredicate, _check_capacity, _check_evict_count
from kvmgr.policy.hints import StoreHint
from kvmgr.policy.tree import PrefixTree, VictimSet, check_new, check_tracked

__all__ = ["OnlinePolicy"]

#: admission thresholds the shadows compare; 0 = admit everything = LRU (the guard)
THRESHOLDS = (0.0, 0.08, 0.16, 0.25, 0.35, 0.5)
_CONTINUE_S = 10.0  # chunks of one prefill within this many seconds form one chain
_PRIOR = 8.0  # pseudo-outcomes pulling a cell's rate to its coarse cell's (and that to all)
# a chain's cell: ghost (2) x parent state (3) x turn (4) x gap (4) x log2 length (7) x hint (3)
_INNER = 4 * 4 * 4 * 7 * 3  # cells per (ghost, parent state)
_NUM_FINE = 2 * 3 * _INNER
_NUM_COARSE = 2 * 3 * 3


class _Chain:
    """One chain a store brought (the unit of admission and of the outcomes learned)."""

    __slots__ = (
        "admitted",
        "cell",
        "end",
        "expires",
        "grown",
        "keys",
        "last",
        "open",
        "p",
        "spare",
        "start",
        "turn",
    )

    def __init__(self, cell: int, now: float, admitted: bool, turn: int = 1, end: int = 0) -> None:
        self.end = end  # depth (blocks from the root) of its last key
        self.start = now  # stored
        self.grown = now  # last chunk of its prefill stored
        self.p = 1.0  # predicted reuse rate when it was admitted or declined
        self.expires: float | None = None  # its TTL hint ran out then
        self.spare = False  # one reprieve from eviction left (predicted or hinted reuse)
        self.keys: list[bytes] = []
        self.cell = cell
        self.turn = turn  # requests of its conversation so far (1: a new conversation)
        self.last = now  # stored, or last used
        self.admitted = admitted
        self.open = True  # no outcome yet


class _Shadow:
    """A sampled LRU of keys only, admitting chains whose predicted reuse is >= threshold."""

    __slots__ = ("capacity", "hits", "keys", "threshold")

    def __init__(self, capacity: int, threshold: float) -> None:
        self.capacity = capacity
        self.threshold = threshold
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0.0

    def see(self, keys: list[bytes], p: float) -> None:
        own = self.keys
        hit = [k for k in keys if k in own]
        if hit:
            self.hits += len(hit)
            deque(map(own.move_to_end, hit), 0)
        if p >= self.threshold and len(hit) < len(keys):
            own.update(dict.fromkeys(keys))  # the hits stay where they were just moved
        excess = len(own) - self.capacity
        if excess > 0:
            deque(map(own.__delitem__, list(itertools.islice(own, excess))), 0)


class OnlinePolicy:
    """LRU eviction with admission learned from the stream, never much worse than LRU.

    Admission
        Each store is split into chains (runs of keys extending each other). A chain's *cell*
        is (first key a ghost hit: evicted or declined before / first seen; its parent
        tracked / a ghost / unknown; times the parent was extended: 1, 2, 3-8, more;
        floor(log2 blocks); the hint: none, continue, not). Per cell the policy learns the
        fraction of chains *reused within reach* (touched, extended, or stored again; a chain
        evicted unused, or declined and not seen again within the LRU's eviction age, is not),
        shrunk to its coarse cell (ghost x parent x hint) and that to the overall rate with
        ``_PRIOR`` pseudo-outcomes. A chain is admitted while its rate is at least the current
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
        self._order: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._tree = PrefixTree()
        self._chain: dict[bytes, _Chain] = {}  # tracked and ghost keys -> their chain
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._kids: dict[bytes, int] = {}  # parent key -> chains stored extending it
        self._pos = [0.0] * _NUM_FINE  # outcomes per cell: reused, all
        self._cnt = [0.0] * _NUM_FINE
        self._cpos = [0.0] * _NUM_COARSE
        self._ccnt = [0.0] * _NUM_COARSE
        self._all = [0.0, 0.0]
        self._declined: deque[_Chain] = deque()
        self._expiry: deque[tuple[float, list[bytes]]] = deque()
        self._sessions: OrderedDict[object, _Chain] = OrderedDict()
        self.reach_s = float("inf")  # EWMA of the eviction age (now - last use of victims)
        shift = max(0, min(6, (capacity // 1024).bit_length() - 1))
        self._sample = 256 >> shift  # a key is sampled when its last byte is below this
        cap = max(1, capacity >> shift)
        self._shadows = [_Shadow(cap, t) for t in THRESHOLDS]
        self._decay_every = 4 * cap
        self._seen = 0
        self._num_spared = 0  # chains with a reprieve left (they may be gone already)
        self.threshold = 0.0  # the one in use
        self.num_declined = 0

    # ------------------------------------------------------------------ prediction

    def _rate(self, cell: int) -> float:
        coarse_cell = cell // _INNER * 3 + cell % 3
        overall = (self._all[0] + 0.5) / (self._all[1] + 1.0)
        coarse = (self._cpos[coarse_cell] + _PRIOR * overall) / (self._ccnt[coarse_cell] + _PRIOR)
        return (self._pos[cell] + _PRIOR * coarse) / (self._cnt[cell] + _PRIOR)

    def _outcome(self, chain: _Chain, reused: bool) -> None:
        if not chain.open:
            return
        chain.open = False
        cell = chain.cell
        coarse_cell = cell // _INNER * 3 + cell % 3
        self._cnt[cell] += 1.0
        self._ccnt[coarse_cell] += 1.0
        self._all[1] += 1.0
        if reused:
            self._pos[cell] += 1.0
            self._cpos[coarse_cell] += 1.0
            self._all[0] += 1.0
        if self._all[1] > 20_000:  # forget slowly: the workload drifts
            for counts in (self._pos, self._cnt, self._cpos, self._ccnt, self._all):
                for i in range(len(counts)):
                    counts[i] *= 0.5

    def _cell(
        self, first: bytes, parent: bytes | None, n: int, hint: StoreHint | None, now: float
    ) -> tuple[int, int, int]:
        """The chain's cell, its turn and the depth of its last key.

        The turn grows only when the chain extends the tip of its parent's chain for the first
        time (a conversation's next request); a chain extending a shared prefix (a block
        extended before, such as a system prompt) starts a new conversation at turn 1.
        """
        ghost = 1 if first in self._ghost else 0
        state, turn, gap, known = 0, 1, 3, 0
        if parent is not None:
            state = 1 if parent in self._order else 2 if parent in self._ghost else 0
            up = self._chain.get(parent)
            known = 0 if up is None else up.end
            if up is not None and self._kids.get(parent, 0) == 0:
                turn = up.turn + 1
                dt = now - up.start
                gap = 0 if dt < 60 else 1 if dt < 240 else 2
        if hint is None or hint.continue_p is None:
            h = 0
        else:
            h = 1 if hint.continue_p >= 0.5 else 2
        t = min(turn, 4) - 1
        length = min(6, max(0, n.bit_length() - 1))
        share = n / (n + known)
        part = 0 if share < 0.1 else 1 if share < 0.3 else 2 if share < 0.7 else 3
        return (
            (((((ghost * 3 + state) * 4 + t) * 4 + gap) * 4 + part) * 7 + length) * 3 + h,
            turn,
            known + n,
        )

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
        full = len(self._order) + n > self.capacity
        if parents[1:] == keys[:-1]:
            starts = [0]
        else:
            starts = [i for i in range(n) if i == 0 or parents[i] != keys[i - 1]]
        declined: set[bytes] = set()
        for s, e in zip(starts, [*starts[1:], n]):
            first, parent = keys[s], parents[s]
            hint = None if hints is None else hints[s]
            up = None if parent is None else self._chain.get(parent)
            if up is not None and self._same_prefill(up, parent, now):
                self._grow(up, list(keys[s:e]), parent in declined, now)
                if not up.admitted or parent in declined:
                    mask[s:e] = False
                    declined.update(keys[s:e])
                continue
            cell, turn, end = self._cell(first, parent, e - s, hint, now)
            self._evidence(first, parent, hint, now)
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
            p = self._rate(cell)
            chunk = list(keys[s:e])
            self._feed_shadows(chunk, p)
            take = p >= self.threshold or not full
            if hint is not None and hint.priority:
                take = hint.priority > 0 or not full
            if parent in declined:
                take = False
            chain = _Chain(cell, now, take, turn, end)
            chain.keys, chain.p = chunk, p
            chain.spare = take and hint is not None and (hint.continue_p or 0.0) >= 0.5
            self._num_spared += chain.spare
            self._chain.update(dict.fromkeys(chunk, chain))
            if hint is not None and hint.session is not None:
                self._sessions[hint.session] = chain
                self._sessions.move_to_end(hint.session)
                if len(self._sessions) > self.capacity:
                    self._sessions.popitem(last=False)
            if hint is not None and hint.ttl_s is not None and take:
                chain.expires = now + hint.ttl_s
                self._expiry.append((chain.expires, chunk))
            if not take:
                mask[s:e] = False
                declined.update(chunk)
                self._declined.append(chain)
                self._ghost.update(dict.fromkeys(chunk))
                self.num_declined += e - s
        self._trim_ghost()
        return mask

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track stored keys, the first most recent (see `EvictionPolicy.insert`).

        Raises:
            BlockStateError: a key is tracked already or repeated.
            ValueError: ``len(parents) != len(keys)``.
        """
        check_new(self._order, keys, parents, self.name)
        self._tree.add(keys, parents)
        self._order.update(zip(reversed(keys), reversed(parents)))
        ghost = self._ghost
        if not ghost.keys().isdisjoint(keys):
            for key in keys:
                ghost.pop(key, None)
        if not self._chain.keys() >= set(keys):  # stored without admit (a direct caller)
            now = self._clock()
            chain = _Chain(0, now, True)
            chain.open = False
            for key in keys:
                self._chain.setdefault(key, chain)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Hits, in prefix order (first = most recent); they are reuse outcomes of their chains."""
        order = self._order
        hit = [k for k in reversed(keys) if k in order]
        deque(map(order.move_to_end, hit), 0)
        if not hit:
            return
        now = self._clock()
        for chain in {id(c): c for c in map(self._chain.get, hit) if c is not None}.values():
            self._outcome(chain, True)
            chain.last = now
        self._feed_shadows(hit[::-1], 1.0)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking ``keys``.

        Raises:
            UnknownKeyError: a key is not tracked; nothing changed then.
        """
        unique = list(dict.fromkeys(keys))
        check_tracked(self._order, unique, self.name)
        self._tree.release(map(self._order.pop, unique))
        for key in unique:
            self._chain.pop(key, None)

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack ``n`` victims (expired TTLs first, then least recently used), or ``None``.

        Raises:
            ValueError: ``n`` negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        order = self._order
        victims = VictimSet(self._tree, order, n, can_evict, protected)
        now = self._clock()
        expired = {}
        for t, chunk in self._expiry:
            if t <= now:
                expired.update(dict.fromkeys(k for k in reversed(chunk) if k in order))
        found = bool(expired) and victims.offer_all(expired)
        spared: dict[int, _Chain] = {}
        if not found:
            if self._num_spared or expired:
                found = victims.offer_all(self._candidates(expired, spared))
            else:  # the common case: plain LRU order, C-level iteration
                found = victims.offer_all(order)
        if not found and spared:  # too few without the reprieves: offer those too
            found = victims.offer_all(
                k for c in spared.values() for k in reversed(c.keys) if k in order
            )
            spared.clear()
        if not found:
            victims.rollback()
            return None
        keys = victims.keys
        for chain in spared.values():  # reprieved: used up, back to the most recent end
            chain.spare = False
            self._num_spared -= 1
            deque(map(order.move_to_end, [k for k in reversed(chain.keys) if k in order]), 0)
        deque(map(order.__delitem__, keys), 0)
        self._ghost.update(dict.fromkeys(keys))
        for chain in dict.fromkeys(map(self._chain.get, keys)):
            if chain is not None:
                self._outcome(chain, False)
                age = now - chain.last
                self.reach_s = (
                    age if self.reach_s == float("inf") else 0.99 * self.reach_s + 0.01 * age
                )
        self._trim_ghost()
        return keys

    # ------------------------------------------------------------------ helpers

    def _same_prefill(self, up: _Chain, parent: bytes | None, now: float) -> bool:
        """A chunked prefill stores one prompt over several steps: a chain at the tip of a
        chain grown within ``_CONTINUE_S`` and never extended is its next chunk, not a turn."""
        return (
            now - up.grown <= _CONTINUE_S
            and bool(up.keys)
            and up.keys[-1] == parent
            and parent not in self._kids
        )

    def _grow(self, up: _Chain, chunk: list[bytes], parent_declined: bool, now: float) -> None:
        """Append the next chunk of a prefill to its chain (same decision, no new outcome)."""
        up.keys.extend(chunk)
        up.end += len(chunk)
        up.grown = now
        self._chain.update(dict.fromkeys(chunk, up))
        self._feed_shadows(chunk, up.p)
        if not up.admitted or parent_declined:
            self._ghost.update(dict.fromkeys(chunk))
            self.num_declined += len(chunk)
        elif up.expires is not None:
            self._expiry.append((up.expires, chunk))

    def _candidates(self, skip: Collection[bytes], spared: dict[int, _Chain]) -> Iterator[bytes]:
        """Keys in LRU order, less ``skip`` and keys of chains with a reprieve left (collected
        into ``spared``)."""
        chain_of = self._chain
        for key in self._order:
            if key in skip:
                continue
            chain = chain_of.get(key)
            if chain is not None and chain.spare:
                spared[id(chain)] = chain
                continue
            yield key

    def _evidence(
        self, first: bytes, parent: bytes | None, hint: StoreHint | None, now: float
    ) -> None:
        """Outcomes a store reveals: its parent's chain extended, a ghost stored again."""
        chain = None if parent is None else self._chain.get(parent)
        if chain is not None:
            self._outcome(chain, True)
            chain.last = now
        chain = self._chain.get(first) if first in self._ghost else None
        if chain is not None:
            self._outcome(chain, now - chain.last <= self.reach_s)
        if hint is not None and hint.session is not None:
            chain = self._sessions.get(hint.session)
            if chain is not None:
                self._outcome(chain, now - chain.last <= self.reach_s)

    def _expire(self, now: float) -> None:
        declined, reach = self._declined, self.reach_s
        while declined and declined[0].last + reach < now:
            self._outcome(declined.popleft(), False)
        expiry = self._expiry
        while expiry and all(k not in self._order for k in expiry[0][1]):
            expiry.popleft()

    def _trim_ghost(self) -> None:
        ghost, chain, order = self._ghost, self._chain, self._order
        excess = len(ghost) - 2 * self.capacity
        if excess > 0:
            old = list(itertools.islice(ghost, excess))
            deque(map(ghost.__delitem__, old), 0)
            gone = [k for k in old if k not in order]
            deque(map(chain.pop, gone, itertools.repeat(None)), 0)
        if len(self._kids) > 8 * self.capacity:
            self._kids.clear()

    def _feed_shadows(self, keys: list[bytes], p: float) -> None:
        limit = self._sample
        sampled = keys if limit == 256 else [k for k in keys if k[-1] < limit]
        if not sampled:
            return
        for shadow in self._shadows:
            shadow.see(sampled, p)
        self._seen += len(sampled)
        if self._seen >= self._decay_every:
            self._seen = 0
            for shadow in self._shadows:
                shadow.hits *= 0.5
        best = max(self._shadows, key=lambda s: s.hits)
        current = next(s for s in self._shadows if s.threshold == self.threshold)
        if best.hits > 1.02 * current.hits + 1.0:
            self.threshold = best.threshold

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __repr__(self) -> str:
        return f"OnlinePolicy(capacity={self.capacity}, num_keys={len(self._order)}, threshold={self.threshold})"
