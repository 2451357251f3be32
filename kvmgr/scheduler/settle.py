"""The settle: every per-call store recorded since the last one prepared in one go (issue 27).

Private to ``kvmgr.scheduler`` (``DeferredStores`` records the calls, ``Bookkeeper`` settles
them). The policy learns the calls as if inserted one by one: a later call more recent, and
within a call the first key most recent, so the keys are indexed and tracked in that order
(the calls reversed) while call ``i`` takes the ``i``-th blocks the pool hands out, as the
calls prepared one by one would.

The keys were absent at their calls; the tier may have indexed one since (a promote from a
lower tier, by a path that did not settle first). ``fresh_store.add_new`` finds that out while
indexing them (one pass, nothing changed when one is present) and is the path taken;
``_prepare_checked`` (``FAST = False``) is the general one: a disjointness check, ``make_room``,
then ``add_pending`` (``tests/scheduler/test_settle_fast.py`` runs both on random programs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvmgr.errors import KVMgrError, PoolExhaustedError
from kvmgr.scheduler.fanout import StoreFanOut
from kvmgr.scheduler.fresh_store import add_new
from kvmgr.scheduler.queue import Kind, Part

if TYPE_CHECKING:
    from kvmgr.scheduler.cpu_tier import CpuTier
    from kvmgr.scheduler.deferred import DeferredStores
    from kvmgr.scheduler.store import Stores

__all__ = ["settle"]

FAST = True  #: ``add_new`` (one pass over the index); False: the checked general path
_REVERSED = slice(None, None, -1)


def settle(deferred: DeferredStores, stores: Stores) -> list[Part]:
    """Prepare every recorded call: one ``Part`` for all of them (empty list: none recorded).

    Uses the batched path's steps (the room with one eviction for all, the PENDING keys and
    the policy's insert, the GPU busy counts over arrays). Should a key have been indexed since
    its call, or the tier refuse the room it promised (a policy that cannot evict every READY
    block without readers), each call is prepared on its own through ``stores.prepare``
    instead, in call order (its present keys skipped, as a store prepared now skips them), and
    a call that still finds no room gets its ``PoolExhaustedError`` through its future.
    """
    if deferred.fan is None:
        return []
    fan, ends, gpu_ids, keys = deferred.take()
    n = len(keys)
    order: Any
    if ends is None:  # one block per call: every key a root
        parents: list[bytes | None] = [None] * n
        in_order, parents_in_order, order = keys[::-1], parents, _REVERSED
    else:
        parents = keys[:]
        calls: list[Any] = []
        start = 0
        for end in ends:
            parents[start + 1 : end] = keys[start : end - 1]
            parents[start] = None
            calls.append(range(start, end))
            start = end
        order = [i for call in reversed(calls) for i in call]
        in_order, parents_in_order = [keys[i] for i in order], [parents[i] for i in order]
        order = np.array(order, dtype=np.int64)
    prepare = add_new if FAST else _prepare_checked
    try:
        cpu_ids = prepare(stores.cpu, in_order, parents_in_order, order)
    except PoolExhaustedError:
        cpu_ids = None
    if cpu_ids is None:
        return _one_by_one(stores, fan, ends, gpu_ids, keys)
    gpu_ids = gpu_ids.copy()
    stores.gpu.acquire_each(gpu_ids)  # two calls may store one GPU block: counted twice
    stores.counters.stores_queued += n
    fan.prepared(ends, gpu_ids, cpu_ids, stores.block_bytes)
    return [Part(Kind.STORE, fan, None, gpu_ids, cpu_ids, keys, parents=parents)]


def _prepare_checked(
    cpu: CpuTier, keys: list[bytes], parents: list[bytes | None], order: slice | np.ndarray
) -> np.ndarray | None:
    """``add_new``'s general path: ``None`` if a key is indexed, else the blocks taken."""
    if not cpu.index.keys().isdisjoint(keys):
        return None
    cpu_ids = cpu.make_room(len(keys), ())  # recorded keys are not in the tier: none to protect
    cpu.add_pending(keys, cpu_ids[order], parents, vouched=True)  # absent above
    return cpu_ids


def _one_by_one(
    stores: Stores, fan: StoreFanOut, ends: Any, gpu_ids: np.ndarray, keys: list[bytes]
) -> list[Part]:
    parts, start, ids = [], 0, gpu_ids.tolist()
    calls = fan.calls()
    for call, end in zip(calls, ends if ends is not None else range(1, len(keys) + 1)):
        try:
            parts.append(stores.prepare(ids[start:end], keys[start:end], None, call, batched=False))
        except KVMgrError as exc:
            stores.counters.reject(getattr(exc, "reason", "cpu_full"))
            call.set_exception(exc)
        start = end
    return parts
