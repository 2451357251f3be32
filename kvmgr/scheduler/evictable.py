"""The CPU tier's eviction test: READY without readers, per key and for many keys at once.

Private to ``kvmgr.scheduler``; ``CpuTier`` builds one ``evictable`` closure over its (never
rebound) index, state bytes and reader counts, and hands it to the policy as ``can_evict``;
``no_room`` is the tier's error when too few blocks qualify.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence

import numpy as np

from kvmgr.errors import PoolExhaustedError

__all__ = ["evictable", "no_room"]


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


def no_room(n: int, num_free: int, num_ready: int, num_blocks: int, evictable: int | None = None) -> PoolExhaustedError:  # fmt: skip
    """The error of a CPU tier that cannot make ``n`` blocks free (``num_free`` free,
    ``evictable`` evictable where counted, ``num_ready`` of ``num_blocks`` pinned so far):
    reason ``"cpu_pinning"`` while the region is still being pinned, else ``"cpu_full"``."""
    pinning = num_ready < num_blocks
    if evictable is None:
        victims = "too few evictable (READY without loads in flight)"
    else:
        victims = f"{evictable} evictable (READY, no loads in flight, no key below them that cannot go)"  # fmt: skip
    return PoolExhaustedError(
        f"cpu tier: need {n} blocks, {num_free} free and {victims}"
        + (f"; {num_ready} of {num_blocks} pinned so far" * pinning)
        + "; nothing changed. Room appears when stores and loads in flight complete"
        " (step(), then await them), when requests are freed or resumed (free(),"
        " resume()) and keys invalidated (invalidate(), clear()); or store fewer"
        ' blocks per call, raise num_cpu_blocks, or set backpressure="wait" to let'
        " the store wait up to store_wait_s seconds for room",
        needed=n,
        available=num_free + (evictable or 0),
        reason="cpu_pinning" if pinning else "cpu_full",
    )
