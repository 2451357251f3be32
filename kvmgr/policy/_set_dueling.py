"""The guard of `OnlinePolicy`: sampled shadow LRUs, one per admission threshold (set dueling).

Offers (to ``kvmgr.policy.online``):
    THRESHOLDS   the admission thresholds the shadows compare; 0 admits everything (plain LRU)
    SetDueling   feeds a fixed sample of the keys to every shadow and picks the threshold of the
                 shadow with the most (decayed) hits (Qureshi et al., ISCA'07)
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

__all__ = ["THRESHOLDS", "SetDueling"]

#: admission thresholds the shadows compare; 0 = admit everything = LRU (the guard)
THRESHOLDS = (0.0, 0.08, 0.16, 0.25, 0.35, 0.5)


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


class SetDueling:
    """One shadow LRU per threshold in `THRESHOLDS` over a fixed 1/2^k sample of the keys.

    A key is sampled when its last byte is below ``256 >> k``, with ``k`` chosen so that each
    shadow (``capacity >> k`` keys) holds at least 1024 keys where the capacity allows it
    (``k <= 6``). The shadows' hits halve every ``4 x`` shadow capacity sampled keys; the
    threshold in use moves to the best shadow's when it leads by 2% (and one hit).

    Args:
        capacity: CPU blocks of the tier the shadows imitate.
    """

    def __init__(self, capacity: int) -> None:
        shift = max(0, min(6, (capacity // 1024).bit_length() - 1))
        self._sample = 256 >> shift  # a key is sampled when its last byte is below this
        cap = max(1, capacity >> shift)
        self._shadows = [_Shadow(cap, t) for t in THRESHOLDS]
        self._decay_every = 4 * cap
        self._seen = 0
        self.threshold = 0.0
        """The admission threshold in use (one of `THRESHOLDS`)."""

    def feed(self, keys: list[bytes], p: float) -> None:
        """Keys looked up or stored, as a chain of predicted reuse rate ``p`` (1.0 for hits)."""
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
