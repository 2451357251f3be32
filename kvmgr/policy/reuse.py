"""Reuse-aware eviction and admission: probation sized by the measured inter-turn gap.

Offers `ReusePolicy`, registered as ``"reuse"``.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvmgr.errors import ConfigError
from kvmgr.policy._reuse_queues import SegmentQueues
from kvmgr.policy._reuse_stats import ReuseStats, Segment, class_of
from kvmgr.policy.base import KeyPredicate, _check_capacity
from kvmgr.policy.tracked import TrackedPolicy, chain_spans
from kvmgr.policy.tree import PrefixTree, VictimSet

__all__ = ["ReusePolicy"]


class ReusePolicy(TrackedPolicy):
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
        adapt: Blocks probation's target grows (shrinks) per block of a ghost hit on an
            unproven (proven) segment, ARC-style; 0 keeps it sized by the gap alone.
        filter_quantile, filter_ratio: Evict by queue (probation first) only while the blocks
            stored during the ``filter_quantile`` gap exceed ``filter_ratio`` of the capacity;
            else plain LRU by key.

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
        self._min_reuse, self._min_trials = min_reuse, min_trials
        self._continue_s = continue_s
        self._stats = ReuseStats(probation_quantile, filter_quantile, dead_quantile, prior)
        self._queues = SegmentQueues(
            capacity, (min_probation, max_probation), filter_ratio, adapt, self._stats, self._clock
        )
        self._seg_of: dict[bytes, Segment] = {}
        # key -> parent, least recently stored or touched first (the order of the LRU regime)
        self._tracked: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._tree = PrefixTree()
        self.num_declined: int = 0
        """Blocks ``admit`` declined so far (each one a copy not made)."""

    # -- protocol ---------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys; see `EvictionPolicy.insert` (same errors)."""
        self._check_new(keys, parents)
        self._tracked.update(zip(reversed(keys), reversed(parents)))
        now = self._clock()
        self._stats.expire(now)
        self._queues.stored(len(keys), now)
        for start, end in chain_spans(keys, parents):
            chain = list(keys[start:end])
            back = self._queues.ghost_hit(chain, now)
            seg = self._attach(chain, parents[start], now, back)
            self._queues.track(seg, len(chain))
            self._seg_of.update(dict.fromkeys(chain, seg))

    def admit(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> np.ndarray:
        """Which keys to store: while the cache is full, chains of classes whose measured
        reuse rate is below ``min_reuse`` are declined, and chains extending them.

        Returns:
            numpy.ndarray: ``bool`` ``[len(keys)]``, True = store.
        """
        accept = np.ones(len(keys), dtype=bool)
        if self._min_reuse <= 0 or len(self._tracked) < self.capacity:
            return accept
        now = self._clock()
        declined: set[bytes | None] = set()
        ghost = self._queues.ghost
        for start, end in chain_spans(keys, parents):
            up = parents[start]
            seg_up = self._seg_of.get(up) if up is not None else None
            ghost_up = ghost.get(up) if up is not None else None
            if up in declined or (
                ghost_up is not None and ghost_up.at_tip(up, now, self._continue_s)
            ):
                accept[start:end] = False
                declined.update(keys[start:end])
                continue
            if ghost and not ghost.keys().isdisjoint(keys[start:end]):
                continue  # stored again: it was needed
            cls, turn = self._class_under(seg_up, up, end - start, now)
            if (
                self._stats.trials[cls] >= self._min_trials
                and self._stats.rate(cls) < self._min_reuse
            ):
                accept[start:end] = False
                declined.update(keys[start:end])
                seg = Segment(list(keys[start:end]), turn, now)
                self._stats.open_trial(seg, now)
                self._queues.remember(dict.fromkeys(seg.keys, seg))
        self.num_declined += int((~accept).sum())
        return accept

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count a reuse of every segment holding a touched key; untracked keys ignored."""
        order = self._tracked
        deque(map(order.move_to_end, filter(order.__contains__, reversed(keys))), 0)
        segs = dict.fromkeys(map(self._seg_of.get, keys))  # in key order: reproducible
        segs.pop(None, None)
        if segs:
            now = self._clock()
            for seg in segs:
                self._reuse(seg, now)  # type: ignore[arg-type]

    def _forget(self, keys: list[bytes]) -> None:
        super()._forget(keys)
        tracked = self._seg_of
        for seg, count in Counter(map(tracked.pop, keys)).items():
            self._queues.drop(seg, count, self._seg_of)
            if seg.tracked:  # a key left from inside the chain: drop it from the key list, so
                # that a key stored again (into another segment) is never listed twice
                seg.keys = [k for k in seg.keys if tracked.get(k) is seg]

    def _evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes]
    ) -> list[bytes] | None:
        """Probation's segments while it is over its target (or main is empty), else main's;
        plain LRU by key while the cache outlasts the measured gap."""
        victims = VictimSet(self._tree, self._tracked, n, can_evict, protected)
        if not self._queues.is_filtering():  # the cache outlasts the gap: plain LRU by key
            victims.offer_all(self._tracked)
        else:
            self._queues.offer(victims, self._seg_of)
        if not victims.is_full:
            victims.rollback()
            return None
        chosen = victims.keys
        segs = list(map(self._seg_of.pop, chosen))
        deque(map(self._tracked.__delitem__, chosen), 0)
        self._queues.remember(zip(chosen, segs))
        for seg, count in Counter(segs).items():
            self._queues.drop(seg, count, self._seg_of)
        return chosen

    # -- introspection ----------------------------------------------------------------------

    @property
    def probation_gap_s(self) -> float:
        """The measured gap probation is sized for (``probation_quantile`` quantile)."""
        return self._stats.probation_gap_s

    @property
    def horizon_s(self) -> float:
        """The dead horizon (``dead_quantile`` quantile of the measured reuse gap)."""
        return self._stats.horizon_s

    def reuse_rates(self) -> np.ndarray:
        """Estimated reuse rate per class, shape ``[3, 12]`` (turn bucket, log2 size)."""
        return self._stats.rates()

    # -- private ----------------------------------------------------------------------------

    def _class_under(
        self, seg_up: Segment | None, up: bytes | None, num_keys: int, now: float
    ) -> tuple[int, int]:
        """Class and turn of a chain of ``num_keys`` stored under ``up`` (in ``seg_up``)."""
        if seg_up is not None and seg_up.at_tip(up, now, self._continue_s):
            return class_of(seg_up.turn, len(seg_up.keys) + num_keys), seg_up.turn
        turn = seg_up.turn + (now - seg_up.start > self._continue_s) if seg_up else 1
        if seg_up is not None and not seg_up.continues(up):
            turn = 1  # a branch off a shared prefix: a new conversation
        return class_of(turn, num_keys), turn

    def _attach(
        self, chain: list[bytes], up: bytes | None, now: float, back: Segment | None
    ) -> Segment:
        """The segment ``chain`` joins: its parent's (same prefill) or a new one."""
        seg_up = self._seg_of.get(up) if up is not None else None
        back_turn = back.turn + 1 if back is not None else 1  # before _reuse may count it
        if seg_up is not None and seg_up.at_tip(up, now, self._continue_s):
            seg_up.keys.extend(chain)  # the next chunk of the same prefill
            seg_up.cls, seg_up.last = class_of(seg_up.turn, len(seg_up.keys)), now
            seg_up.grown = now
            return seg_up
        inherit = seg_up is not None and seg_up.continues(up)
        if seg_up is not None:
            self._reuse(seg_up, now)  # a later request extended it: its prefix was reused
            seg_up.forks += 1
        # turn = requests of this conversation so far (this one was counted by _reuse); only
        # a conversation's next request inherits it, a branch off a shared prefix (a system
        # prompt every conversation extends) starts at 1 (the v1 turn inherited the shared
        # segment's count, so 99% of outcomes fell into the turn >= 3 classes)
        turn = max(seg_up.turn if inherit and seg_up is not None else 1, back_turn)
        seg = Segment(chain, turn, now)
        self._stats.open_trial(seg, now)
        self._queues.add(seg, proven=back is not None)  # stored again after eviction: proven
        return seg

    def _reuse(self, seg: Segment, now: float) -> None:
        """Close the segment's trial as reused, promote it and open the next trial."""
        if now - seg.start <= self._continue_s:
            return  # the same request again (loads over several steps), not a new turn
        if not seg.resolved:
            self._stats.count(seg, reused=True, gap_s=now - seg.start)
        seg.turn += 1
        seg.cls = class_of(seg.turn, len(seg.keys))
        seg.start, seg.last, seg.resolved = now, now, False
        self._stats.open_trial(seg, now)
        self._queues.promote(seg)
