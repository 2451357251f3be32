"""Every group's checks before any group of a ``DeepSeekV4Offload`` store is queued.

Private to ``kvmgr.models.deepseek_v4``. A group's ``swap_out`` that refuses (bad ids, no room)
after earlier groups queued theirs would leave those stores running on blocks the caller, told
the store failed, reuses (newuser14: their keys became READY with another request's bytes).
The checks are not exact, so ``queue_stores`` also turns such a late refusal into a future that
fails only once the queued copies ended (session 14).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvmgr._futures import all_ended, fail_after, quiet
from kvmgr.errors import KVMgrError, PoolExhaustedError

__all__ = ["check_stores", "queue_stores"]


def check_stores(
    managers: Mapping[str, Any], ids: Mapping[str, Sequence[int]], keys: Mapping[str, list[bytes]]
) -> None:
    """Check every group's GPU ids, then that every group has room for its new keys (those
    the tier does not hold: ``swap_out`` skips a PENDING key too, ``OffloadManager.held``):
    free blocks plus READY blocks without loads in flight, less the store's own READY keys
    (never evicted for it), as ``GroupedManager.store`` counts. With ``backpressure="wait"``
    only a store larger than the tier is refused (``swap_out`` waits for room). Not exact:
    a key not admitted yet (``store_threshold`` > 1) counts as new (a refusal too many); and
    (open) a READY key counted as evictable may be the parent of one that cannot go (PENDING,
    read, or this store's), which leaf-first policies never evict: that group's ``swap_out``
    still refuses after the check (``GroupedManager``'s ``check_room`` counts the same way).

    Raises:
        InvalidBlockError: a group's ids are bad (as ``OffloadManager.swap_out``).
        PoolExhaustedError: a group lacks room (reason ``"cpu_full"``). Nothing was queued.
    """
    for name in keys:
        managers[name].check_gpu_blocks(ids[name], "store")
    for name, group_keys in keys.items():
        mgr = managers[name]
        new = len(group_keys) - mgr.held(group_keys)  # PENDING or READY: no new block
        if not new:
            continue
        if mgr.config.backpressure == "wait":
            room = mgr.config.num_cpu_blocks
        else:
            ready = sum(mgr.peek([key]) for key in group_keys)  # touches nothing
            stats = mgr.statistics()
            evictable = max(0, stats.cpu_keys_ready - stats.cpu_keys_loading - ready)
            room = max(0, stats.cpu_blocks_ready - stats.cpu_blocks_used) + evictable
        if room < new:
            raise PoolExhaustedError(
                f"group {name!r}: need {new} CPU blocks, {room} free or evictable; no group's "
                "store was queued",
                needed=new,
                available=room,
                reason="cpu_full",
            )


def queue_stores(
    managers: Mapping[str, Any], ids: Mapping[str, Sequence[int]], keys: Mapping[str, list[bytes]]
) -> asyncio.Future[list[Any]]:
    """``check_stores``, then every group's ``swap_out``: a future of the per-group
    ``SwapResult`` list that ends with every group's copy. A group that still refuses after
    earlier groups queued (the room check's blind spot) makes it a future that fails with that
    refusal once the queued copies ended; a refusal with nothing queued is raised."""
    check_stores(managers, ids, keys)
    futures: list[asyncio.Future[Any]] = []
    for name, group_keys in keys.items():
        if not group_keys:
            continue
        try:
            futures.append(managers[name].swap_out(ids[name], group_keys))
        except KVMgrError as error:
            if not futures:
                raise  # nothing queued: nothing changed
            return quiet(asyncio.ensure_future(fail_after(futures, error)))
    return quiet(asyncio.ensure_future(all_ended(futures)))
