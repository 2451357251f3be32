"""Every group's checks before any group of a ``DeepSeekV4Offload`` store is queued.

Private to ``kvmgr.models.deepseek_v4``. A group's ``swap_out`` that refuses (bad ids, no room)
after earlier groups queued theirs would leave those stores running on blocks the caller, told
the store failed, reuses (newuser14: their keys became READY with another request's bytes).
The room check is exact for the policies' rule (session 15: a READY key above one that cannot go
is no victim); the store still queues through ``kvmgr._futures.queue_all``, which would turn a
late refusal into a future that fails only once the queued copies ended (session 14).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvmgr.errors import PoolExhaustedError

__all__ = ["check_stores"]


def check_stores(
    managers: Mapping[str, Any], ids: Mapping[str, Sequence[int]], keys: Mapping[str, list[bytes]]
) -> None:
    """Check every group's GPU ids, then that every group's ``swap_out`` would take its keys
    and find room for them (``OffloadManager.check_store_room``: the keys the tier does not
    hold and the store threshold admits, against free blocks plus what the policy could
    really evict; with ``backpressure="wait"`` only a store larger than the tier is refused),
    as ``GroupedManager.store`` checks. A policy's ``admit`` is not asked: with one, every new
    key counts (a refusal too many, never one too few).

    Raises:
        InvalidBlockError: a group's ids are bad (as ``OffloadManager.swap_out``).
        InvalidKeyError: a group's keys are repeated (as ``swap_out``).
        PoolExhaustedError: a group lacks room (reason ``"cpu_full"``). Nothing was queued.
    """
    for name in keys:
        managers[name].check_gpu_blocks(ids[name], "store")
    for name, group_keys in keys.items():
        try:
            managers[name].check_store_room(group_keys)
        except PoolExhaustedError as exc:
            raise exc.reworded(f"group {name!r}: {exc}; no group's store was queued") from exc
