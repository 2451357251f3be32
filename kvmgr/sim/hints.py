"""Oracle hints of known quality for the simulator: the future, blurred to a precision.

Offers:
    continue_labels  per request: does a later request extend its prompt (the conversation
                     continues from it)?
    oracle_hints     one ``StoreHint(continue_p=1 or 0)`` per request, right with a chosen
                     precision and recall (seeded)

A serving loop that produces hints (an LPC-style continuation predictor, a product signal)
wants to know what a hint of a given quality buys before building it; ``kvmgr simulate
--hint-precision P`` answers that with these hints (docs/policies.md has the curve).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmgr.policy.hints import StoreHint
from kvmgr.sim.trace import TraceRequest

__all__ = ["continue_labels", "oracle_hints"]


def continue_labels(
    requests: Sequence[TraceRequest], horizon_s: float = float("inf")
) -> np.ndarray:
    """``bool [len(requests)]``: within ``horizon_s`` of request ``i``'s arrival a later request
    holds its deepest full trace block (equal id at the same position), so a later turn
    re-reads all of its prefix. Requests without a full block are False."""
    following: dict[tuple[int, int], float] = {}  # block -> arrival of its latest user so far
    out = np.zeros(len(requests), dtype=bool)
    for i in range(len(requests) - 1, -1, -1):  # backwards: `following` holds the next use
        r = requests[i]
        n = r.num_full_trace_blocks
        if n:
            deepest = (n - 1, r.hash_ids[n - 1])
            nxt = following.get(deepest)
            out[i] = nxt is not None and nxt - r.arrival_s <= horizon_s
            for j in range(n):
                following[(j, r.hash_ids[j])] = r.arrival_s
    return out


def oracle_hints(
    requests: Sequence[TraceRequest],
    precision: float,
    recall: float = 0.75,
    *,
    horizon_s: float = float("inf"),
    seed: int = 0,
) -> list[StoreHint]:
    """Hints ``continue_p = 1.0`` (predicted to continue) or ``0.0``, per request.

    ``round(recall * positives)`` true positives are drawn at random, then enough false
    positives from the negatives that ``TP / (TP + FP) = precision`` (as far as there are
    negatives). Deterministic for a seed.

    Raises:
        ValueError: ``precision`` not in (0, 1] or ``recall`` not in [0, 1].
    """
    if not 0.0 < precision <= 1.0:
        raise ValueError(f"hint precision: expected (0, 1], got {precision!r}")
    if not 0.0 <= recall <= 1.0:
        raise ValueError(f"hint recall: expected [0, 1], got {recall!r}")
    labels = continue_labels(requests, horizon_s)
    rng = np.random.Generator(np.random.PCG64(seed))
    pos, neg = np.flatnonzero(labels), np.flatnonzero(~labels)
    tp = rng.choice(pos, size=round(recall * len(pos)), replace=False)
    num_fp = min(len(neg), round(len(tp) * (1.0 - precision) / precision))
    fp = rng.choice(neg, size=num_fp, replace=False)
    said = np.zeros(len(requests), dtype=bool)
    said[tp] = True
    said[fp] = True
    yes, no = StoreHint(continue_p=1.0), StoreHint(continue_p=0.0)
    return [yes if s else no for s in said.tolist()]
