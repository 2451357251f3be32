"""What one request showed ``KvmgrOffloadingManager``, and how an offer of keys splits.

Private to ``kvmgr.integrations.vllm``. `Access` lives in the request's ``ReqContext``: key
positions (prefix parents, `RequestKeys`), the keys in the order first seen, the keys the
request read from the tier. `split_offer` sorts a ``prepare_store`` offer into the keys to
store (with their parents) and the resident ones, recording what the request showed; `saw_loaded`
records the keys of a ``prepare_load``; `finished_keys` the keys a finished request
touches; `request_order` is vLLM's head-to-tail order of a
request's keys (``order_request_keys``) for keys whose positions are known.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import islice

from vllm.v1.kv_offload.base import OffloadKey

from kvmgr.integrations.vllm import _seam
from kvmgr.integrations.vllm._request_keys import RequestKeys

__all__ = ["Access", "Offer", "finished_keys", "request_order", "saw_loaded", "split_offer"]

PositionOf = Callable[[OffloadKey], "int | None"]
_READY = int(_seam.CpuState.READY)


class Access(RequestKeys):
    """What one request showed the manager: key positions (`RequestKeys`), ``seen`` (every
    key, in the order first shown) and ``reused`` (keys it read from the tier, or offered
    again when READY: vLLM's reuse rule)."""

    __slots__ = ("reused", "seen")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner, self.generation, self.groups = owner, generation, {}
        self.seen: dict[OffloadKey, None] = {}
        self.reused: set[OffloadKey] = set()


class Offer:
    """A ``prepare_store`` offer split: ``new`` keys (not in the tier) with their prefix
    ``parents``, ``resident`` keys (in the tier: never victims of the store) and ``fresh``
    ones (resident keys the request shows for the first time)."""

    __slots__ = ("fresh", "new", "parents", "resident")

    def __init__(
        self,
        new: list[OffloadKey],
        parents: list[OffloadKey | None],
        resident: list[OffloadKey],
        fresh: list[OffloadKey],
    ) -> None:
        self.new, self.parents, self.resident, self.fresh = new, parents, resident, fresh


_NOTHING: list[OffloadKey] = []  # shared, never changed: the fast path's empty lists


def split_offer(
    access: Access,
    keys: Sequence[OffloadKey],
    blocks: list[int | None],
    state: bytearray,
    position_of: PositionOf,
) -> Offer:
    """Split ``keys`` (``blocks[i]``: the tier's block of ``keys[i]``, ``None`` if not in it;
    ``state``: the tier's block states) and record what the request showed: each key first seen
    (with its position), and READY keys as reused."""
    seen, reused = access.seen, access.reused
    if blocks.count(None) == len(keys) and seen.keys().isdisjoint(keys):
        return _all_new(access, keys, position_of)  # the common store
    new: list[OffloadKey] = []
    new_positions: list[int | None] = []
    resident: list[OffloadKey] = []
    fresh: list[OffloadKey] = []
    placed: list[OffloadKey] = []  # keys shown for the first time, with a position
    placed_at: list[int] = []
    for key, block in zip(keys, blocks):
        first = key not in seen
        position = position_of(key) if first or block is None else None
        if first:
            seen[key] = None
            if position is not None:
                placed.append(key)
                placed_at.append(position)
        if block is None:
            new.append(key)
            new_positions.append(position)
            continue
        resident.append(key)
        if first:
            fresh.append(key)
        if state[block] == _READY:  # READY keys offered again: reused (vLLM's rule)
            reused.add(key)
    if placed:
        access.add_many(placed, placed_at)
    return Offer(new, access.parents(new, new_positions), resident, fresh)


def _all_new(access: Access, keys: Sequence[OffloadKey], position_of: PositionOf) -> Offer:
    """`split_offer` of keys all new to the tier and to the request (one pass per step)."""
    if len(keys) == 1:  # the per-call store: no C-level passes to set up
        key = keys[0]
        access.seen[key] = None
        new, positions = [key], [position_of(key)]
    else:
        seen = access.seen
        for key in keys:  # a loop: cheaper than update(zip(...)) for a chunk's few keys
            seen[key] = None
        new = list(keys)
        positions = list(map(position_of, new))
    parents = access.extend_run(new, positions)
    if parents is None:
        placed = [(k, p) for k, p in zip(new, positions) if p is not None]
        access.add_many([k for k, _ in placed], [p for _, p in placed])
        parents = access.parents(new, positions)
    return Offer(new, parents, _NOTHING, _NOTHING)


def saw_loaded(
    access: Access, keys: Sequence[OffloadKey], position_of: PositionOf
) -> list[OffloadKey]:
    """Record keys a request loads (all in the tier): each as reused, and the ones shown for
    the first time with their positions. Returns those first-time keys."""
    access.reused.update(keys)
    seen, shown = access.seen, dict.fromkeys(keys)
    if not seen.keys().isdisjoint(shown):
        shown = {k: None for k in shown if k not in seen}
    fresh = list(shown)
    if not fresh:
        return fresh
    seen.update(shown)
    positions = list(map(position_of, fresh))
    if access.extend_run(fresh, positions) is None:
        for key, position in zip(fresh, positions):
            if position is not None:
                access.add(key, position)
    return fresh


def finished_keys(
    access: Access,
    index_get: Callable[[OffloadKey], int | None],
    state: bytearray,
    touch_is_recency: bool,
    position_of: PositionOf,
) -> list[OffloadKey]:
    """The request finished: the keys to touch, head first (vLLM's order), and its keys
    forgotten. With LRU (``touch_is_recency``) every key in the tier, else the reused ones
    still READY (none when it read nothing)."""
    seen, access.seen = access.seen, {}
    if not touch_is_recency and not access.reused:  # nothing read: nothing to touch
        return []
    keys = request_order(list(seen), position_of)
    if touch_is_recency:
        return [k for k in keys if index_get(k) is not None]
    reused = access.reused
    return [
        k for k in keys if k in reused and (b := index_get(k)) is not None and state[b] == _READY
    ]


def request_order(keys: list[OffloadKey], position_of: PositionOf) -> list[OffloadKey]:
    """vLLM's ``order_request_keys`` for one group list: ``keys`` by position when every
    position is known (stable), else as they are."""
    positions = list(map(position_of, keys))
    if None in positions:
        return keys
    known: list[int] = positions  # type: ignore[assignment]  # no None left
    if all(map(operator.le, known, islice(known, 1, None))):
        return keys
    order = sorted(range(len(keys)), key=known.__getitem__)
    return [keys[i] for i in order]
