"""The eviction order of `ReusePolicy`: its segments in a probation FIFO and a main LRU.

Offers (to ``kvmgr.policy.reuse``):
    SegmentQueues   the two queues, probation's block count and its target: the blocks stored
                    during the measured reuse gap (the store rate times the gap quantile), so a
                    new segment survives the typical gap when the capacity allows it; and the
                    ghost of evicted or declined keys, whose hits adapt that target
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from kvmgr.policy._reuse_stats import ReuseStats, Segment
from kvmgr.policy.tree import VictimSet

__all__ = ["SegmentQueues"]


class SegmentQueues:
    """Probation (segments never reused, oldest stored first) and main (segments reused at
    least once, least recently reused first).

    Args:
        capacity: CPU blocks.
        bounds: ``(min, max)`` of probation's target, fractions of ``capacity``.
        filter_ratio: segments are filtered (evicted by queue, not by key) while the blocks
            stored during the ``filter_quantile`` gap exceed this fraction of ``capacity``.
        adapt: blocks the target moves per block of a ghost hit (grows for an unproven
            segment, shrinks for a proven one).
        stats: the statistics whose gap quantiles size probation.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        capacity: int,
        bounds: tuple[float, float],
        filter_ratio: float,
        adapt: float,
        stats: ReuseStats,
        clock: Callable[[], float],
    ) -> None:
        self._capacity = capacity
        self._min_probation = bounds[0] * capacity
        self._max_probation = bounds[1] * capacity
        self._filter_ratio = filter_ratio
        self._adapt = adapt
        self._stats = stats
        self._clock = clock
        self._shift = 0.0  # blocks added to the gap-sized probation target by ghost hits
        self.probation: OrderedDict[Segment, None] = OrderedDict()  # by store time
        self.main: OrderedDict[Segment, None] = OrderedDict()  # by last reuse
        self.num_probation = 0  # resident blocks of probation segments
        self._stored = 0.0  # blocks stored, and since when, for the store rate
        self._first_store_s: float | None = None
        self.ghost: OrderedDict[bytes, Segment] = OrderedDict()  # key -> its old segment

    def stored(self, num_blocks: int, now: float) -> None:
        """Count blocks stored (the store rate)."""
        if self._first_store_s is None:
            self._first_store_s = now
        self._stored += num_blocks

    def add(self, seg: Segment, *, proven: bool) -> None:
        """Queue a new segment: into main if ``proven`` (a conversation seen before)."""
        if proven:
            seg.proven = True
            self.main[seg] = None
        else:
            self.probation[seg] = None

    def track(self, seg: Segment, num_keys: int) -> None:
        """``num_keys`` more keys of ``seg`` are resident."""
        seg.tracked += num_keys
        if not seg.proven:
            self.num_probation += num_keys

    def promote(self, seg: Segment) -> None:
        """A resident segment was reused: to the most recent end of main."""
        if not seg.tracked:
            return
        if seg.proven:
            self.main.move_to_end(seg)
        else:
            seg.proven = True
            del self.probation[seg]
            self.num_probation -= seg.tracked
            self.main[seg] = None

    def drop(self, seg: Segment, count: int, seg_of: dict[bytes, Segment]) -> None:
        """``count`` keys of ``seg`` stopped being tracked (``seg_of``: the tracked keys')."""
        seg.tracked -= count
        if not seg.proven:
            self.num_probation -= count
        if seg.tracked == 0:
            (self.main if seg.proven else self.probation).pop(seg, None)
        else:
            while seg.keys and seg.keys[-1] not in seg_of:
                seg.keys.pop()

    def remember(self, entries: Iterable[tuple[bytes, Segment]] | Mapping[bytes, Segment]) -> None:
        """Keys evicted or declined, with their segments, join the ghost (at most 4 x
        ``capacity`` keys; the oldest leave first)."""
        ghost, bound = self.ghost, 4 * self._capacity
        ghost.update(entries)
        while len(ghost) > bound:
            ghost.popitem(last=False)

    def ghost_hit(self, chain: list[bytes], now: float) -> Segment | None:
        """Keys evicted or declined, stored again (they leave the ghost): their segments were
        reused. Returns the one of the highest turn (the new segment inherits its turn and
        goes to main), or ``None``."""
        ghost = self.ghost
        if not ghost or ghost.keys().isdisjoint(chain):
            return None
        segs = dict.fromkeys(ghost.pop(key) for key in chain if key in ghost)  # in key order
        for seg in segs:
            if not seg.resolved:
                self._stats.count(seg, reused=True, gap_s=now - seg.start)
            # ARC-style adaptation: evicted too early from probation -> grow it; from main
            # -> shrink it (steps in blocks, bounded)
            step = self._adapt * len(chain) * (-1.0 if seg.proven else 1.0)
            self._shift = min(max(self._shift + step, -self._capacity), self._capacity)
        return max(segs, key=lambda s: s.turn)

    def is_filtering(self) -> bool:
        """Whether the blocks stored during the measured gap exceed ``filter_ratio`` of the
        capacity: new segments would be evicted before their typical reuse anyway."""
        if self._first_store_s is None:
            return False
        elapsed = max(self._clock() - self._first_store_s, 1.0)
        wanted = self._stored / elapsed * self._stats.filter_gap_s
        return wanted > self._filter_ratio * self._capacity

    def target(self) -> float:
        """Probation's target size in blocks."""
        if self._first_store_s is None:
            return self._max_probation
        elapsed = max(self._clock() - self._first_store_s, 1.0)
        wanted = self._stored / elapsed * self._stats.probation_gap_s + self._shift
        return min(max(wanted, self._min_probation), self._max_probation)

    def offer(self, victims: VictimSet, seg_of: dict[bytes, Segment]) -> None:
        """Offer segments' keys, tip first, until ``victims`` is full: from probation while
        it holds more blocks than its target (counting those offered away), else from main."""
        target = self.target()
        scans = {True: iter(self.probation), False: iter(self.main)}
        virtual_probation = self.num_probation
        offered: set[bytes] = set()
        fronts = {True: next(scans[True], None), False: next(scans[False], None)}
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
                if seg_of.get(k) is seg and k not in offered and not offered.add(k)  # type: ignore[func-returns-value]
            )
            if from_probation:
                virtual_probation -= len(victims.keys) - before
