"""Whether a keyed store would find room in the CPU tier, asked without changing anything.

Private to ``kvmgr.scheduler``. ``check_store_room`` is the dry run of ``Stores._reserve``'s room
step for a caller whose one store spans several managers and must know that every part finds
room before it queues any (``kvmgr.groups``, ``kvmgr.models.deepseek_v4``; issue 27, session
15). ``num_victims`` counts what the policy could really evict: the policies evict leaves only
(every victim set is closed under tracked children, ``kvmgr.policy.base``), so a READY key
without readers is no victim while a key below it cannot go (PENDING, being read, protected).

Cost: nothing beyond the key checks while the free blocks cover the store; otherwise one numpy
pass over the tier's states and reader counts, and a walk up the chains from every key that
cannot go (each block once), O(blocked keys + their ancestors).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvmgr.scheduler.cpu_tier import CpuState, CpuTier
from kvmgr.scheduler.evictable import no_room
from kvmgr.scheduler.keys import check_keys, check_parents
from kvmgr.scheduler.store import Stores

__all__ = ["check_store_room", "num_victims"]

_READY, _PENDING = int(CpuState.READY), int(CpuState.PENDING)


def num_victims(cpu: CpuTier, protected: Collection[bytes]) -> int:
    """How many keys ``cpu.policy.evict(n, cpu.can_evict, protected)`` could take at most:
    READY keys without readers, not in ``protected``, none of whose indexed descendants is
    PENDING, read or protected. Changes nothing."""
    index, up = cpu.index, cpu.chains.up_block
    kept = {index[k] for k in protected if k in index}
    ok_kept = sum(cpu.state[b] == _READY and cpu.readers[b] == 0 for b in kept)
    candidates = len(index) - cpu.num_pending - cpu.num_loading - ok_kept
    if not candidates:
        return 0
    state, readers = cpu.state_np, cpu.readers_np
    stuck = np.flatnonzero((state == _PENDING) | ((state == _READY) & (readers > 0))).tolist()
    seen: set[int] = set()  # the ancestors of a key that cannot go: no victim either
    for block in (*stuck, *kept):
        b = up[block]
        while b >= 0 and b not in seen:
            seen.add(b)
            b = up[b]
    return candidates - sum(b not in kept and state[b] == _READY and readers[b] == 0 for b in seen)


def check_store_room(
    stores: Stores, keys: object, parents: object, *, wait: bool
) -> tuple[list[bytes], int]:
    """Raise if ``prepare(ids, keys, parents, ..., batched=False)`` would refuse for its keys
    or for room now; change nothing. Returns (the keys as a list, the new keys it would
    store). The new keys are those not in the tier (any state) that the store threshold
    admits; a policy with ``admit`` is not asked (its answer may change its state), so every
    such key counts (a refusal too many, never one too few). ``wait``: with
    ``backpressure="wait"`` only a store of more new keys than the tier's blocks is refused.

    Raises:
        InvalidKeyError: bad or repeated keys, bad parents, or a key cycle (as ``prepare``).
        PoolExhaustedError: too few free and evictable blocks (as ``CpuTier.make_room``).
    """
    checked = check_keys(keys, distinct=True)
    all_parents = check_parents(checked, parents)
    cpu = stores.cpu
    fresh = stores._fresh(checked, False)
    present = len(fresh) < len(checked)  # ``prepare`` protects the call's keys then
    if fresh:
        cpu.chains.check([checked[i] for i in fresh], [all_parents[i] for i in fresh])
    if stores._threshold > 1:  # keys not seen often enough are not stored yet
        seen, threshold = stores._seen, stores._threshold
        fresh = [i for i in fresh if seen.get(checked[i], 0) + 1 >= threshold]
    n = len(fresh)
    if wait:
        if n > cpu.num_blocks:
            raise no_room(n, cpu.pool.num_free, cpu.pool.num_ready, cpu.num_blocks)
        return checked, n
    free = cpu.pool.num_free + cpu.blocks_to_grow() - cpu.reserved
    if n > free:
        victims = num_victims(cpu, checked if present else ())
        if n > free + victims:
            raise no_room(n, max(0, free), cpu.pool.num_ready, cpu.num_blocks, victims)
    return checked, n
