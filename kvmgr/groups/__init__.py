"""Cache groups: a hybrid model's KV cache as several groups over one restorable key space.

Offers:
    GroupKind, GroupSpec, GroupedLayout   what each group holds (spec.py)
    offload_key, split_offload_key        ``(block hash, group)`` keys as vLLM's ``OffloadKey``
    RestorePlan, find_restorable, plan_at the restorable-prefix lookup (restore.py)
    GroupIndex                            held keys, prefix chains, orphans (index.py)
    GroupedManager, GroupedStore          one ``OffloadManager`` per group (manager.py)
    GroupSpecError, GroupKeyError         typed errors, raised before any state changes

``spec``, ``restore`` and ``index`` import neither torch nor asyncio (the scheduler side);
``GroupedManager`` is imported lazily, since it needs the manager (and torch).
"""

from __future__ import annotations

from typing import Any

from kvmgr.groups.errors import GroupKeyError, GroupSpecError
from kvmgr.groups.index import GroupIndex
from kvmgr.groups.restore import RestorePlan, find_restorable, plan_at
from kvmgr.groups.spec import (
    GroupedLayout,
    GroupKind,
    GroupSpec,
    offload_key,
    split_offload_key,
)

__all__ = [
    "GroupIndex",
    "GroupKeyError",
    "GroupKind",
    "GroupSpec",
    "GroupSpecError",
    "GroupedLayout",
    "GroupedManager",
    "GroupedStore",
    "RestorePlan",
    "find_restorable",
    "offload_key",
    "plan_at",
    "split_offload_key",
]


def __getattr__(name: str) -> Any:
    if name in ("GroupedManager", "GroupedStore"):
        from kvmgr.groups import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'kvmgr.groups' has no attribute {name!r}")
