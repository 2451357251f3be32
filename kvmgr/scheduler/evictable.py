"""The CPU tier's eviction test: READY without readers, per key and for many keys at once.

Private to ``kvmgr.scheduler``; ``CpuTier`` builds one ``evictable`` closure over its (never
rebound) index, state bytes and reader counts, and hands it to the policy as ``can_evict``.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["evictable"]


def evictable(
    index: dict[bytes, int], state: bytearray, readers: array.array[int], ready: int
) -> Callable[[bytes], bool]:
    """Whether a key is READY (state byte ``ready``) without readers, as a closure over the
    tier's (never rebound) index and arrays: the policy asks it once per candidate victim, so
    it skips a method's attribute lookups. Its ``every(keys)`` asks it of many keys at once,
    with one numpy pass over the states and reader counts (``kvmgr.policy.runs``)."""
    get = index.get
    state_np = np.frombuffer(state, dtype=np.uint8)
    readers_np = np.frombuffer(readers, dtype=np.int64)

    def can_evict(key: bytes) -> bool:
        block = get(key)
        return block is not None and state[block] == ready and readers[block] == 0

    def every(keys: Sequence[bytes]) -> bool:
        try:
            ids = np.fromiter(map(index.__getitem__, keys), dtype=np.int64, count=len(keys))
        except KeyError:
            return False
        return bool((state_np[ids] == ready).all()) and not readers_np[ids].any()

    can_evict.every = every  # type: ignore[attr-defined]
    return can_evict
