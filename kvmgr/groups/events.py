"""Grouped KV events in vLLM's shapes: each block hash published with its group.

Offers:
    VLLM_SPEC_KIND      GroupKind -> vLLM's ``KVCacheSpecKind`` value
    group_event_format  the ``VllmEventFormat`` of one group (group index, kind, window, size)
    to_vllm_events      grouped ``KVEvent``s (``kvmgr.reports``) -> vLLM's ``BlockStored`` / ``BlockRemoved`` /
                        ``AllBlocksCleared``, hashes without the group suffix

A ``GroupedManager``'s events name ``OffloadKey`` bytes (``block_hash + group id``). vLLM's
publisher sends the block hash and the group apart (``BlockStored.group_idx``), so the suffix
is split off here, parents included, and each event takes its group's format. Needs the
``events`` extra (msgspec), imported only when called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvmgr.groups.errors import GroupKeyError
from kvmgr.groups.spec import GroupedLayout, GroupKind, split_offload_key

__all__ = ["VLLM_SPEC_KIND", "group_event_format", "to_vllm_events"]

#: vLLM ``KVCacheSpecKind`` values (vllm/v1/kv_cache_interface.py); a compressed group has
#: none of its own there.
VLLM_SPEC_KIND = {
    GroupKind.FULL: "full_attention",
    GroupKind.SLIDING_WINDOW: "sliding_window",
    GroupKind.RECURRENT: "mamba",
    GroupKind.MLA: "mla_attention",
    GroupKind.COMPRESSED: "unknown",
}


def group_event_format(layout: GroupedLayout, index: int, **kwargs: Any) -> Any:
    """The ``kvmgr.events.VllmEventFormat`` of group ``index`` (``kwargs``: ``hash_format``,
    ``media``)."""
    from kvmgr.events.vllm_format import VllmEventFormat

    spec = layout.groups[index]
    return VllmEventFormat(
        block_size=spec.block_size,
        group_idx=layout.group_id(index),
        kv_cache_spec_kind=VLLM_SPEC_KIND[spec.kind],
        sliding_window=spec.window,
        **kwargs,
    )


def to_vllm_events(layout: GroupedLayout, events: Iterable[Any], **kwargs: Any) -> list[Any]:
    """vLLM event structs of grouped events, in order (one ``AllBlocksCleared`` per run of
    ``cleared`` events: every group's manager reports its close).

    Args:
        kwargs: ``hash_format`` / ``media`` as ``VllmEventFormat``.

    Raises:
        GroupKeyError: a key that is not a grouped key of this layout.
    """
    ids = {layout.group_id(i): i for i in range(len(layout.groups))}
    formats: Mapping[int, Any] = {
        i: group_event_format(layout, i, **kwargs) for i in range(len(layout.groups))
    }
    out: list[Any] = []
    last_cleared = False
    for event in events:
        if event.kind == "cleared":
            if not last_cleared:
                out.extend(formats[0].convert(event))
            last_cleared = True
            continue
        last_cleared = False
        if not event.keys:
            continue
        split = [split_offload_key(k) for k in event.keys]
        gid = split[0][1]
        if gid not in ids or any(g != gid for _, g in split):
            raise GroupKeyError(f"event keys name groups {sorted({g for _, g in split})}")
        parents = None
        if event.parents is not None:
            parents = tuple(None if p is None else split_offload_key(p)[0] for p in event.parents)
        plain = attrs.evolve(event, keys=tuple(h for h, _ in split), parents=parents)
        out.extend(formats[ids[gid]].convert(plain))
    return out
