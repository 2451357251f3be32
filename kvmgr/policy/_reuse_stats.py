"""What `ReusePolicy` learns from: its segments, their classes, and the reuse statistics.

Offers (to ``kvmgr.policy.reuse``):
    Segment      the blocks one request stored in one go (a chain): the unit the policy learns on
    class_of     a segment's class: conversation turn bucket (1, 2, >= 3) x floor(log2 blocks)
    ReuseStats   outcomes per class (reuse rates shrunk to the overall rate) and the histogram
                 of measured reuse gaps with the quantiles the policy sizes itself by
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

__all__ = ["NUM_SIZES", "NUM_TURNS", "ReuseStats", "Segment", "class_of"]

NUM_TURNS = 3  # turn buckets: 1, 2, >= 3
NUM_SIZES = 12  # size buckets: floor(log2(blocks)), capped
_GAP_EDGES = np.geomspace(1.0, 1e5, 61)  # s; log-spaced bins of the reuse-gap histogram


class Segment:
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
        self.cls = class_of(turn, len(keys))
        self.start = now  # start of the current trial: stored, or last reused
        self.last = now  # last event (store, extension, reuse)
        self.grown = now  # last time a chunk of its prefill was stored
        self.resolved = False  # the current trial ended (reused, or judged dead)
        self.proven = False  # reused at least once: lives in the main queue
        self.tracked = 0  # keys of it still resident

    def at_tip(self, key: bytes | None, now: float, continue_s: float) -> bool:
        """Whether a chain under ``key`` continues this segment (same prefill, at its tip)."""
        return bool(self.keys) and self.keys[-1] == key and now - self.grown <= continue_s

    def continues(self, key: bytes | None) -> bool:
        """Whether a chain under ``key`` is the next request of this segment's conversation:
        it extends the tip and nothing was attached under the segment before."""
        return self.forks == 0 and bool(self.keys) and self.keys[-1] == key


def class_of(turn: int, size: int) -> int:
    """The class index of a segment of ``size`` blocks at conversation turn ``turn``."""
    size_bucket = min(int(math.log2(max(size, 1))), NUM_SIZES - 1)
    return (min(turn, NUM_TURNS) - 1) * NUM_SIZES + size_bucket


class ReuseStats:
    """Trial outcomes per class and the measured reuse gaps (seconds from a segment's store,
    or its last reuse, to its next reuse).

    The gap histogram has 60 log-spaced bins over 1 s .. 1e5 s, seeded with a weak log-uniform
    prior over 10 s .. 1000 s; its quantiles are refreshed every 32 new gaps.

    Args:
        probation_quantile, filter_quantile, dead_quantile: the gap quantiles kept as
            `probation_gap_s`, `filter_gap_s` and `horizon_s`.
        prior: pseudo-counts shrinking each class rate towards the overall rate.
    """

    def __init__(
        self, probation_quantile: float, filter_quantile: float, dead_quantile: float, prior: float
    ) -> None:
        num_classes = NUM_TURNS * NUM_SIZES
        self.reused = np.zeros(num_classes)
        self.trials = np.zeros(num_classes)
        self._prior = prior
        self._quantiles = (probation_quantile, filter_quantile, dead_quantile)
        centers = np.sqrt(_GAP_EDGES[:-1] * _GAP_EDGES[1:])
        self._gaps = np.where((centers > 10) & (centers < 1000), 0.5, 0.0)
        self._num_new_gaps = 0
        self._gap_cdf = np.empty(0)
        self.probation_gap_s = self.filter_gap_s = self.horizon_s = 0.0
        self._refresh_gaps()
        self._open: deque[tuple[float, Segment]] = deque()  # trials by start time

    def open_trial(self, seg: Segment, now: float) -> None:
        """``seg``'s trial started ``now`` (stored, or reused): it ends by `count` or as dead."""
        self._open.append((now, seg))

    def expire(self, now: float) -> None:
        """Open trials older than the dead horizon end as dead."""
        horizon, opened = self.horizon_s, self._open
        while opened and now - opened[0][0] > horizon:
            started, seg = opened.popleft()
            if not seg.resolved and seg.start == started:
                self.count(seg, reused=False)

    def count(self, seg: Segment, *, reused: bool, gap_s: float = 0.0) -> None:
        """End ``seg``'s current trial: reused after ``gap_s`` seconds, or dead."""
        seg.resolved = True
        self.trials[seg.cls] += 1
        if reused:
            self.reused[seg.cls] += 1
            i = int(np.searchsorted(_GAP_EDGES, max(gap_s, 1.0))) - 1
            self._gaps[min(max(i, 0), len(self._gaps) - 1)] += 1.0
            self._num_new_gaps += 1
            if self._num_new_gaps % 32 == 0:
                self._refresh_gaps()

    def rate(self, cls: int) -> float:
        """Estimated reuse rate of class ``cls`` (a fraction)."""
        overall = (self.reused.sum() + 1.0) / (self.trials.sum() + 3.0)
        return float((self.reused[cls] + self._prior * overall) / (self.trials[cls] + self._prior))

    def rates(self) -> np.ndarray:
        """Estimated reuse rate per class, shape ``[3, 12]`` (turn bucket, log2 size)."""
        rates = [self.rate(c) for c in range(NUM_TURNS * NUM_SIZES)]
        return np.array(rates).reshape(NUM_TURNS, NUM_SIZES)

    def _refresh_gaps(self) -> None:
        self._gap_cdf = np.cumsum(self._gaps) / self._gaps.sum()
        probation, filtering, dead = self._quantiles
        self.probation_gap_s = self._quantile(probation)
        self.filter_gap_s = self._quantile(filtering)
        self.horizon_s = self._quantile(dead)

    def _quantile(self, q: float) -> float:
        i = int(np.searchsorted(self._gap_cdf, q))
        return float(_GAP_EDGES[min(i + 1, len(_GAP_EDGES) - 1)])
