"""Every group's checks before any group of a ``DeepSeekV4Offload`` store is queued.

Private to ``kvmgr.models.deepseek_v4``. A group's ``swap_out`` that refuses (bad ids, no room)
after earlier groups queued theirs would leave those stores running on blocks the caller, told
the store failed, reuses (newuser14: their keys became READY with another request's bytes).
The checks are not exact, so the store queues through ``kvmgr._futures.queue_all``, which turns
such a late refusal into a future that fails only once the queued copies ended (session 14).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvmgr.errors import PoolExhaustedError

__all__ = ["check_stores"]


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
