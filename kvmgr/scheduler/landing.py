"""Completion: a lane's outcome applied to the bookkeeping, with array operations.

Private to ``kvmgr.scheduler``; ``Bookkeeper.complete`` calls ``complete_lane``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from kvmgr.scheduler.jobs import Direction
from kvmgr.scheduler.lanes import Kind, Lane


class _Books(Protocol):
    """What landing reads of the ``Bookkeeper`` (which imports this module: no import back)."""

    cpu: Any
    gpu: Any
    requests: Any
    events: Any
    counters: Any


__all__ = ["Landed", "complete_lane"]


class Landed(NamedTuple):
    """Keyed stores that just became READY: ``keys`` on CPU blocks ``cpu_ids`` (int64,
    aligned). Returned by ``Bookkeeper.complete`` for the write-through to lower tiers."""

    keys: list[bytes]
    cpu_ids: np.ndarray


def complete_lane(
    books: _Books, lane: Lane, gpu_ids: np.ndarray, cpu_ids: np.ndarray, ok: bool
) -> Landed | None:
    """Apply the outcome of a lane's copy (``ok``: it completed on every rank) to every part.

    ``gpu_ids``/``cpu_ids`` are the lane's ids as its job carried them. Array operations
    over the lane's blocks, plus one step per request-level part; futures are the caller's
    to resolve after this returns.

    Returns:
        The keyed stores that became READY (``Landed``), or ``None`` (none, or a failure).
    """
    cpu, counters = books.cpu, books.counters
    n = len(cpu_ids)
    books.gpu.release(gpu_ids)
    requests = lane.requests
    if lane.direction is Direction.D2H:
        keys = lane.keys
        landed = None
        if ok:
            cpu.stores_landed(cpu_ids, all_pending=not requests)
            counters.stores_completed += n
            _emit_stored(books, lane)
            if keys:
                landed = Landed(keys, _store_ids(lane, cpu_ids))
        else:
            cpu.stores_failed(keys, cpu_ids)
            counters.stores_failed += n
        for part in requests:
            books.requests.preempt_done(part, ok)
        return landed
    if not requests:
        cpu.remove_readers(cpu_ids)
    else:
        loads = [np.asarray(p.cpu_ids, dtype=np.int64) for p in lane.parts if p.kind is Kind.LOAD]
        if loads:
            cpu.remove_readers(np.concatenate(loads))
        for part in requests:
            books.requests.resume_done(part, ok)
    if ok:
        counters.loads_completed += n
    else:
        counters.loads_failed += n
    return None


def _emit_stored(books: _Books, lane: Lane) -> None:
    """The ``stored`` event of a landed D2H lane: one for the lane, with the token ids
    concatenated when every keyed store gave them (of one block size) or none did; one per
    store otherwise, so that no event mixes rows with and without tokens."""
    events, keys = books.events, lane.keys
    if not events.enabled or not keys:
        return
    if lane.num_token_parts == 0:
        events.stored(keys, lane.parents)
        return
    stores = [p for p in lane.stores if p.keys]
    tokens = [p.token_ids for p in stores if p.token_ids is not None]
    if len(tokens) == len(stores) and len({t.shape[1] for t in tokens}) == 1:
        events.stored(keys, lane.parents, np.concatenate(tokens) if len(tokens) > 1 else tokens[0])
        return
    for part in stores:
        part_keys: list[bytes] = part.keys  # type: ignore[assignment]
        parents = part.parents if part.parents is not None else [None, *part_keys[:-1]]
        events.stored(part_keys, parents, part.token_ids)


def _store_ids(lane: Lane, cpu_ids: np.ndarray) -> np.ndarray:
    """CPU ids of the lane's keyed stores, aligned with ``lane.keys``."""
    if not lane.requests:  # stores only: the lane's ids, in part order
        return cpu_ids
    return np.concatenate([np.asarray(p.cpu_ids, dtype=np.int64) for p in lane.stores])
