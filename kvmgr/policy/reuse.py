"""Reuse-aware eviction and admission: probation sized by the measured inter-turn gap.

Offers `ReusePolicy`, registered as ``"reuse"``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvmgr.errors import ConfigError
from kvmgr.policy.base import KeyPredicate, _check_capacity, _check_evict_count
from kvmgr.policy.tree import PrefixTree, VictimSet, check_new, check_tracked

__all__ = ["ReusePolicy"]

_NUM_TURNS = 3  # turn buckets: 1, 2, >= 3
_NUM_SIZES = 12  # size buckets: floor(log2(blocks)), capped
_GAP_EDGES = np.geomspace(1.0, 1e5, 61)  # s; log-spaced bins of the reuse-gap histogram


class _Segment:
    """The blocks one request stored in one go (a chain): the unit the policy learns on."""

    __slots__ = (
        "cls",
        "forks",
        "grown",
        "keys",
        "last",
        "proven",
        "resolved",
        "start",
        "tracked",
        "turn",
    )

    def __init__(self, keys: list[bytes], turn: int, now: float) -> None:
        self.keys = keys  # chain order; the tip (last) is evicted first
        self.turn = turn  # turns of its conversation that used it (1 = just stored)
        self.forks = 0  # later requests' chains attached under it
        self.cls = _class_of(turn, len(keys))
        self.start = now  # start of the current trial: stored, or last reused
        self.last = now  # last event (store, extension, reuse)
        self.grown = now  # last time a chunk of its prefill was stored
        self.resolved = False  # the current trial ended (reused, or judged dead)
        self.proven = False  # reused at least once: lives in the main queue
        self.tracked = 0  # keys of it still resident


class ReusePolicy:
    """Keeps blocks of conversations that came back; gives new ones a measured probation.

    A *segment* is a chain of blocks one request stored (the chunks of one prefill within
    ``continue_s`` of each other join one segment). Evidence that a segment was *reused*: a
    touch of one of its keys, a later request storing a chain that extends it, or one of its
    keys stored again after it was evicted or declined (a ghost hit: the lookup missed and
    the block was recomputed).

    Queues
        - *probation*: segments never reused, oldest stored first (FIFO). Its target size is
          the number of blocks stored during the measured inter-turn gap (the
          ``probation_quantile`` quantile of the reuse gaps seen, times the measured store
          rate), between ``min_probation`` and ``max_probation`` of the capacity. A new
          segment so survives the typical gap when the capacity allows it.
        - *main*: segments reused at least once (a live conversation), least recently
          reused first (LRU). A ghost hit stores the segment straight into main.
        ``evict`` takes from probation while it exceeds its target (or main is empty), else
        from main; a segment's keys are offered tip first to a prefix-consistent
        `VictimSet`. Unproven victims' keys go to a bounded ghost (keys only).

    Admission
        Per class (conversation turn 1, 2, >= 3 x floor(log2(blocks))) the policy learns the
        fraction of segments reused within the dead horizon (the ``dead_quantile`` quantile
        of the gaps), shrunk towards the overall rate with ``prior`` pseudo-counts. While the
        cache is full, ``admit`` declines chains of classes whose rate is below
        ``min_reuse`` once they have ``min_trials`` outcomes (declined keys join the ghost,
        so a class that was wrongly declined earns its way back).

    Complexity
        ``insert``/``admit``: O(len(keys)) C-level dict work plus O(chains) Python steps;
        ``touch``: O(len(keys)) C-level plus O(segments touched); ``evict``: O(n + keys
        skipped) plus O(1) per segment visited.

    Args:
        capacity: Number of CPU blocks.
        clock: Seconds (any origin, monotonic); the simulator passes its virtual clock, a serving
            loop ``time.monotonic`` (the default).
        probation_quantile: Quantile of the measured reuse gap that probation should cover.
        min_probation, max_probation: Bounds of the probation target, fractions of ``capacity``.
        min_reuse: Admission threshold on a class's reuse rate (0 disables admission control).
        min_trials: Outcomes a class needs before ``admit`` may decline it.
        dead_quantile: Quantile of the measured reuse gap after which an unused segment counts as dead.
        prior: Pseudo-counts shrinking each class rate towards the overall rate.
        continue_s: A chain extending the tip of a segment stored less than this ago joins it.

    Raises:
        ConfigError: Bad capacity or an option out of range.
    """

    name: str = "reuse"

    def __init__(
        self,
        capacity: int,
        *,
        clock: Callable[[], float] | None = None,
        probation_quantile: float = 0.05,
        min_probation: float = 0.1,
        max_probation: float = 0.9,
        min_reuse: float = 0.15,
        min_trials: int = 20,
        dead_quantile: float = 0.95,
        prior: float = 10.0,
        continue_s: float = 10.0,
        adapt: float = 0.0,
        filter_quantile: float = 0.75,
        filter_ratio: float = 0.75,
    ) -> None:
        self.capacity: int = _check_capacity(capacity)
        if not (
            0.0 < probation_quantile < 1.0
            and 0.0 <= min_probation <= max_probation <= 1.0
            and 0.0 <= min_reuse < 1.0
            and 0.5 <= dead_quantile < 1.0
            and prior > 0
            and continue_s >= 0
        ):
            raise ConfigError(f"reuse policy: an option is out of range ({locals()!r})")
        self._clock = clock if clock is not None else time.monotonic
        self._probation_quantile = probation_quantile
        self._min_probation = min_probation * capacity
        self._max_probation = max_probation * capacity
        self._min_reuse = min_reuse
        self._min_trials = min_trials
        self._dead_quantile = dead_quantile
        self._prior = prior
        self._continue_s = continue_s
        self._adapt = adapt
        self._filter_quantile = filter_quantile
        self._filter_ratio = filter_ratio
        self._filter_gap_s = 0.0
        self._shift = 0.0  # blocks added to the gap-sized probation target by ghost hits
        self._probation: OrderedDict[_Segment, None] = OrderedDict()  # by store time
        self._main: OrderedDict[_Segment, None] = OrderedDict()  # by last reuse
        self._num_probation = 0  # resident blocks of probation segments
        self._stored = 0.0  # blocks stored, and since when, for the store rate
        self._first_store_s: float | None = None
        num_classes = _NUM_TURNS * _NUM_SIZES
        self._reused = np.zeros(num_classes)
        self._trials = np.zeros(num_classes)
        # reuse-gap histogram, seeded with a weak log-uniform prior over 10 s .. 1000 s
        centers = np.sqrt(_GAP_EDGES[:-1] * _GAP_EDGES[1:])
        self._gaps = np.where((centers > 10) & (centers < 1000), 0.5, 0.0)
        self._num_new_gaps = 0
        self._gap_cdf = np.empty(0)
        self._probation_gap_s = self._horizon_s = 0.0
        self._filter_quantile, self._filter_gap_s = filter_quantile, 0.0
        self._refresh_gaps()
        self._seg_of: dict[bytes, _Segment] = {}
        # key -> parent, least recently stored or touched first (the order of the LRU regime)
        self._parent_of: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._tree = PrefixTree()
        self._open: deque[tuple[float, _Segment]] = deque()
        self._ghost: OrderedDict[bytes, _Segment] = OrderedDict()
        self.num_declined: int = 0
        """Blocks ``admit`` declined so far (each one a copy not made)."""

    # -- protocol ---------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys; see `EvictionPolicy.insert` (same errors)."""
        check_new(self._parent_of, keys, parents, self.name)
        self._tree.add(keys, parents)
        self._parent_of.update(zip(reversed(keys), reversed(parents)))
        now = self._clock()
        self._expire(now)
        if self._first_store_s is None:
            self._first_store_s = now
        self._stored += len(keys)
        for start, end in _chains(keys, parents):
            chain = list(keys[start:end])
            back = self._ghost_evidence(chain, now)
            seg = self._attach(chain, parents[start], now, back)
            seg.tracked += len(chain)
            if not seg.proven:
                self._num_probation += len(chain)
            self._seg_of.update(dict.fromkeys(chain, seg))

    def admit(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> np.ndarray:
        """Which keys to store: while the cache is full, chains of classes whose measured
        reuse rate is below ``min_reuse`` are declined, and chains extending them.

        Returns:
            numpy.ndarray: ``bool`` ``[len(keys)]``, True = store.
        """
        accept = np.ones(len(keys), dtype=bool)
        if self._min_reuse <= 0 or len(self._parent_of) < self.capacity:
            return accept
        now = self._clock()
        declined: set[bytes | None] = set()
        for start, end in _chains(keys, parents):
            up = parents[start]
            seg_up = self._seg_of.get(up) if up is not None else None
            ghost_up = self._ghost.get(up) if up is not None else None
            if up in declined or (ghost_up is not None and self._is_tip(ghost_up, up, now)):
                accept[start:end] = False
                declined.update(keys[start:end])
                continue
            if self._ghost and not self._ghost.keys().isdisjoint(keys[start:end]):
                continue  # stored again: it was needed
            if seg_up is not None and self._is_tip(seg_up, up, now):
                turn, size = seg_up.turn, len(seg_up.keys) + end - start
            else:
                turn = seg_up.turn + (now - seg_up.start > self._continue_s) if seg_up else 1
                if seg_up is not None and not _continues(seg_up, up):
                    turn = 1  # a branch off a shared prefix: a new conversation
                size = end - start
            cls = _class_of(turn, size)
            if self._trials[cls] >= self._min_trials and self._rate(cls) < self._min_reuse:
                accept[start:end] = False
                declined.update(keys[start:end])
                seg = _Segment(list(keys[start:end]), turn, now)
                self._open.append((now, seg))
                self._remember(seg.keys, seg)
        self.num_declined += int((~accept).sum())
        return accept

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count a reuse of every segment holding a touched key; untracked keys ignored."""
        order = self._parent_of
        deque(map(order.move_to_end, filter(order.__contains__, reversed(keys))), 0)
        segs = dict.fromkeys(map(self._seg_of.get, keys))  # in key order: reproducible
        segs.pop(None, None)
        if segs:
            now = self._clock()
            for seg in segs:
                self._reuse(seg, now)  # type: ignore[arg-type]

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking ``keys``.

        Raises:
            UnknownKeyError: If a key is not tracked; nothing changed then.
        """
        unique = list(dict.fromkeys(keys))
        check_tracked(self._parent_of, unique, self.name)
        self._tree.release(map(self._parent_of.pop, unique))
        tracked = self._seg_of
        for seg, count in Counter(map(tracked.pop, unique)).items():
            self._drop(seg, count)
            if seg.tracked:  # a key left from inside the chain: drop it from the key list, so
                # that a key stored again (into another segment) is never listed twice
                seg.keys = [k for k in seg.keys if tracked.get(k) is seg]

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Untrack and return ``n`` victims (probation over target first), or ``None``.

        Raises:
            ValueError: If ``n`` is negative or not an ``int``.
        """
        _check_evict_count(n)
        if n == 0:
            return []
        victims = VictimSet(self._tree, self._parent_of, n, can_evict, protected)
        tracked, target = self._seg_of, self._probation_target()
        scans = {True: iter(self._probation), False: iter(self._main)}
        virtual_probation = self._num_probation
        offered: set[bytes] = set()
        fronts = {True: next(scans[True], None), False: next(scans[False], None)}
        if not self._is_filtering():  # the cache outlasts the gap: plain LRU by key
            victims.offer_all(self._parent_of)
            fronts = {True: None, False: None}  # every key was offered
        while not victims.is_full and (fronts[True] is not None or fronts[False] is not None):
            if fronts[True] is None or fronts[False] is None:
                from_probation = fronts[True] is not None
            else:  # it cannot: keep unproven segments short, proven ones long
                from_probation = virtual_probation > target
            seg = fronts[from_probation]
            assert seg is not None
            fronts[from_probation] = next(scans[from_probation], None)
            before = len(victims.keys)
            # tip first; ancestors of a blocked key wait in the set
            # each key once (VictimSet's contract), from the segment that owns it now: a key
            # evicted or removed and stored again may still be listed by its old segment, or
            # twice by one segment it rejoined
            victims.offer_all(
                k
                for k in reversed(seg.keys)
                if tracked.get(k) is seg and k not in offered and not offered.add(k)  # type: ignore[func-returns-value]
            )
            if from_probation:
                virtual_probation -= len(victims.keys) - before
        if not victims.is_full:
            victims.rollback()
            return None
        chosen = victims.keys
        segs = list(map(tracked.pop, chosen))
        deque(map(self._parent_of.__delitem__, chosen), 0)
        self._ghost.update(zip(chosen, segs))
        self._trim_ghost()
        for seg, count in Counter(segs).items():
            self._drop(seg, count)
        return chosen

    def __len__(self) -> int:
        return len(self._parent_of)

    def __contains__(self, key: object) -> bool:
        return key in self._parent_of

    # -- introspection ----------------------------------------------------------------------

    @property
    def probation_gap_s(self) -> float:
        """The measured gap probation is sized for (``probation_quantile`` quantile)."""
        return self._probation_gap_s

    @property
    def horizon_s(self) -> float:
        """The dead horizon (``dead_quantile`` quantile of the measured reuse gap)."""
        return self._horizon_s

    def reuse_rates(self) -> np.ndarray:
        """Estimated reuse rate per class, shape ``[3, 12]`` (turn bucket, log2 size)."""
        rates = [self._rate(c) for c in range(_NUM_TURNS * _NUM_SIZES)]
        return np.array(rates).reshape(_NUM_TURNS, _NUM_SIZES)

    # -- private ----------------------------------------------------------------------------

    def _is_filtering(self) -> bool:
        """Whether the blocks stored during the measured gap exceed ``filter_ratio`` of the
        capacity: new segments would be evicted before their typical reuse anyway."""
        if self._first_store_s is None:
            return False
        elapsed = max(self._clock() - self._first_store_s, 1.0)
        return self._stored / elapsed * self._filter_gap_s > self._filter_ratio * self.capacity

    def _probation_target(self) -> float:
        if self._first_store_s is None:
            return self._max_probation
        elapsed = max(self._clock() - self._first_store_s, 1.0)
        wanted = self._stored / elapsed * self._probation_gap_s + self._shift
        return min(max(wanted, self._min_probation), self._max_probation)

    def _rate(self, cls: int) -> float:
        overall = (self._reused.sum() + 1.0) / (self._trials.sum() + 3.0)
        return float(
            (self._reused[cls] + self._prior * overall) / (self._trials[cls] + self._prior)
        )

    def _is_tip(self, seg: _Segment, key: bytes | None, now: float) -> bool:
        """Whether a chain under ``key`` continues ``seg`` (same prefill, at its tip)."""
        return bool(seg.keys) and seg.keys[-1] == key and now - seg.grown <= self._continue_s

    def _attach(
        self, chain: list[bytes], up: bytes | None, now: float, back: _Segment | None
    ) -> _Segment:
        """The segment ``chain`` joins: its parent's (same prefill) or a new one."""
        seg_up = self._seg_of.get(up) if up is not None else None
        back_turn = back.turn + 1 if back is not None else 1  # before _reuse may count it
        if seg_up is not None and self._is_tip(seg_up, up, now):
            seg_up.keys.extend(chain)  # the next chunk of the same prefill
            seg_up.cls, seg_up.last = _class_of(seg_up.turn, len(seg_up.keys)), now
            seg_up.grown = now
            return seg_up
        inherit = seg_up is not None and _continues(seg_up, up)
        if seg_up is not None:
            self._reuse(seg_up, now)  # a later request extended it: its prefix was reused
            seg_up.forks += 1
        # turn = requests of this conversation so far (this one was counted by _reuse); only
        # a conversation's next request inherits it, a branch off a shared prefix (a system
        # prompt every conversation extends) starts at 1 (the v1 turn inherited the shared
        # segment's count, so 99% of outcomes fell into the turn >= 3 classes)
        turn = max(seg_up.turn if inherit and seg_up is not None else 1, back_turn)
        seg = _Segment(chain, turn, now)
        self._open.append((now, seg))
        if back is not None:  # stored again after eviction: a proven conversation
            seg.proven = True
            self._main[seg] = None
        else:
            self._probation[seg] = None
        return seg

    def _reuse(self, seg: _Segment, now: float) -> None:
        """Close the segment's trial as reused, promote it and open the next trial."""
        if now - seg.start <= self._continue_s:
            return  # the same request again (loads over several steps), not a new turn
        if not seg.resolved:
            self._count(seg, reused=True, gap_s=now - seg.start)
        seg.turn += 1
        seg.cls = _class_of(seg.turn, len(seg.keys))
        seg.start, seg.last, seg.resolved = now, now, False
        self._open.append((now, seg))
        if not seg.tracked:
            return
        if seg.proven:
            self._main.move_to_end(seg)
        else:
            seg.proven = True
            del self._probation[seg]
            self._num_probation -= seg.tracked
            self._main[seg] = None

    def _drop(self, seg: _Segment, count: int) -> None:
        """``count`` keys of ``seg`` stopped being tracked."""
        seg.tracked -= count
        if not seg.proven:
            self._num_probation -= count
        if seg.tracked == 0:
            (self._main if seg.proven else self._probation).pop(seg, None)
        else:
            tracked = self._seg_of
            while seg.keys and seg.keys[-1] not in tracked:
                seg.keys.pop()

    def _ghost_evidence(self, chain: list[bytes], now: float) -> _Segment | None:
        """Keys evicted or declined while unproven, stored again: their segment was reused.
        Returns that segment (the new one inherits its turn and goes to main)."""
        ghost = self._ghost
        if not ghost or ghost.keys().isdisjoint(chain):
            return None
        segs = dict.fromkeys(ghost.pop(key) for key in chain if key in ghost)  # in key order
        for seg in segs:
            if not seg.resolved:
                self._count(seg, reused=True, gap_s=now - seg.start)
            # ARC-style adaptation: evicted too early from probation -> grow it; from main
            # -> shrink it (steps in blocks, bounded)
            step = self._adapt * len(chain) * (-1.0 if seg.proven else 1.0)
            self._shift = min(max(self._shift + step, -self.capacity), self.capacity)
        return max(segs, key=lambda s: s.turn)

    def _count(self, seg: _Segment, *, reused: bool, gap_s: float = 0.0) -> None:
        seg.resolved = True
        self._trials[seg.cls] += 1
        if reused:
            self._reused[seg.cls] += 1
            i = int(np.searchsorted(_GAP_EDGES, max(gap_s, 1.0))) - 1
            self._gaps[min(max(i, 0), len(self._gaps) - 1)] += 1.0
            self._num_new_gaps += 1
            if self._num_new_gaps % 32 == 0:
                self._refresh_gaps()

    def _refresh_gaps(self) -> None:
        self._gap_cdf = np.cumsum(self._gaps) / self._gaps.sum()
        self._probation_gap_s = self._quantile(self._probation_quantile)
        self._filter_gap_s = self._quantile(self._filter_quantile)
        self._horizon_s = self._quantile(self._dead_quantile)

    def _quantile(self, q: float) -> float:
        i = int(np.searchsorted(self._gap_cdf, q))
        return float(_GAP_EDGES[min(i + 1, len(_GAP_EDGES) - 1)])

    def _expire(self, now: float) -> None:
        """Open trials older than the dead horizon end as dead."""
        horizon, opened = self._horizon_s, self._open
        while opened and now - opened[0][0] > horizon:
            started, seg = opened.popleft()
            if not seg.resolved and seg.start == started:
                self._count(seg, reused=False)

    def _remember(self, keys: list[bytes], seg: _Segment) -> None:
        self._ghost.update(dict.fromkeys(keys, seg))
        self._trim_ghost()

    def _trim_ghost(self) -> None:
        ghost, bound = self._ghost, 4 * self.capacity
        while len(ghost) > bound:
            ghost.popitem(last=False)


def _continues(seg: _Segment, key: bytes | None) -> bool:
    """Whether a chain under ``key`` is the next request of ``seg``'s conversation: it extends
    the segment's tip and nothing was attached under the segment before."""
    return seg.forks == 0 and bool(seg.keys) and seg.keys[-1] == key


def _class_of(turn: int, size: int) -> int:
    size_bucket = min(int(math.log2(max(size, 1))), _NUM_SIZES - 1)
    return (min(turn, _NUM_TURNS) - 1) * _NUM_SIZES + size_bucket


def _chains(keys: Sequence[bytes], parents: Sequence[bytes | None]) -> list[tuple[int, int]]:
    """``[start, end)`` of the maximal runs where each key extends the previous one."""
    n = len(keys)
    if n == 0:
        return []
    if list(parents[1:]) == list(keys[:-1]):
        return [(0, n)]
    cuts = [i for i in range(1, n) if parents[i] != keys[i - 1]]
    return list(itertools.pairwise([0, *cuts, n]))
