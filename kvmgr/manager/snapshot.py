"""A frozen picture of the manager's whole bookkeeping, for tests and invariant checks.

Offers:
    ManagerSnapshot   every block, key, table and queued or in-flight swap
    KeySnapshot, TableSnapshot, SwapSnapshot, BatchSnapshot   its parts

``OffloadManager.snapshot()`` builds one in O(blocks); ``kvmgr.testing.check_invariants``
reads nothing else, so the checker never depends on private attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvmgr.errors import RankTimeoutError
from kvmgr.manager.backpressure import WaitingStore
from kvmgr.pool.block_table import Tier
from kvmgr.scheduler.bookkeeping import Bookkeeper
from kvmgr.scheduler.cpu_tier import CpuState
from kvmgr.scheduler.fanout import StoreFanOut
from kvmgr.scheduler.gpu_blocks import GpuState
from kvmgr.scheduler.jobs import Direction
from kvmgr.scheduler.queue import Batch, Kind, Part, SwapQueue

__all__ = [
    "BatchSnapshot",
    "KeySnapshot",
    "ManagerSnapshot",
    "SwapSnapshot",
    "TableSnapshot",
    "take_snapshot",
]


@attrs.frozen
class KeySnapshot:
    """A key of the CPU tier: its block, that block's state (``PENDING``/``READY``), readers."""

    cpu_block_id: int
    state: CpuState
    readers: int


@attrs.frozen
class TableSnapshot:
    """A request's block table."""

    req_id: Hashable
    tier: Tier
    block_ids: tuple[int, ...]
    gpu_owned: bool | None
    moving: bool


@attrs.frozen
class SwapSnapshot:
    """A swap not settled yet.

    Attributes:
        kind: ``"store"``, ``"load"``, ``"preempt"``, ``"resume"``, ``"promote"`` (a lower
            tier's blocks being read into PENDING CPU blocks by ``fetch``), or ``"waiting"`` (a
            store waiting for room with ``backpressure="wait"``: it holds its GPU blocks, one
            busy count each, and has no CPU blocks yet).
        direction: D2H or H2D.
        gpu_block_ids / cpu_block_ids: its blocks, aligned.
        keys: keyed swaps: the keys copied.
        req_id: request-level swaps: the request.
        batch_seq: the batch carrying it, or ``None`` while queued.
        future_done: whether its future is already resolved (only a cancelled or an
            abandoned one may be).
        future_cancelled: whether its awaiter cancelled the future.
        abandoned: its future failed with ``RankTimeoutError`` while a rank past the deadline
            may still run the copy: it stays in flight, its blocks fenced for good.
    """

    kind: str
    direction: Direction
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    req_id: Hashable | None
    batch_seq: int | None
    future_done: bool
    future_cancelled: bool
    abandoned: bool = False


@attrs.frozen
class BatchSnapshot:
    """A batch in flight: its number, direction, engine batch id, GPU blocks, fences;
    ``engine_batch_ids``: every engine batch it joins (one, or a layerwise operation's groups)."""

    seq: int
    direction: Direction
    engine_batch_id: int | None
    gpu_block_ids: tuple[int, ...]
    wait_for: tuple[int, ...]
    engine_wait_for: tuple[int, ...]
    engine_batch_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class ManagerSnapshot:
    """The manager's bookkeeping at one moment.

    Attributes:
        keys: key -> its CPU block, state and readers.
        policy_keys: keys of the index that the eviction policy tracks.
        num_policy_keys: keys the policy tracks in all (equal to ``len(keys)`` when the two
            agree).
        cpu_states: the state of every CPU block (``CpuState``), index = block id.
        cpu_allocated: CPU blocks the allocator has handed out.
        gpu_states: the state of every owned GPU block (``GpuState``), or ``None`` when the
            caller owns the GPU pool.
        gpu_allocated: GPU blocks the owned allocator has handed out (``None`` if not owned).
        gpu_busy: GPU block -> queued or in-flight copies that use it (non-zero entries).
        tables: request -> its block table.
        swaps: queued and in-flight swaps, queued first, in order.
        batches: batches in flight, in submission order.
        key_parents: key -> the key it extends (``None``: a root), as the manager records it
            for every indexed key (the parents a store named).
    """

    keys: Mapping[bytes, KeySnapshot]
    policy_keys: frozenset[bytes]
    num_policy_keys: int
    cpu_states: tuple[CpuState, ...]
    cpu_allocated: frozenset[int]
    gpu_states: tuple[GpuState, ...] | None
    gpu_allocated: frozenset[int] | None
    gpu_busy: Mapping[int, int]
    tables: Mapping[Hashable, TableSnapshot]
    swaps: tuple[SwapSnapshot, ...]
    batches: tuple[BatchSnapshot, ...]
    key_parents: Mapping[bytes, bytes | None] = attrs.field(factory=dict)


_KIND_NAMES = {
    Kind.STORE: "store",
    Kind.LOAD: "load",
    Kind.PREEMPT: "preempt",
    Kind.RESUME: "resume",
}


def _ints(ids: object) -> tuple[int, ...]:
    return tuple(int(b) for b in np.asarray(ids, dtype=np.int64).reshape(-1))


def _abandoned(future: Any) -> bool:
    """Whether ``future`` failed with ``RankTimeoutError`` (its copy may still run)."""
    return (
        future.done()
        and not future.cancelled()
        and isinstance(future.exception(), RankTimeoutError)
    )


def _swaps(part: Part, batch_seq: int | None) -> list[SwapSnapshot]:
    """The part's swaps: one, or one per call for recorded per-call stores (a fan-out)."""
    future = part.future
    if not isinstance(future, StoreFanOut):
        return [
            SwapSnapshot(
                kind=_KIND_NAMES[part.kind],
                direction=part.direction,
                gpu_block_ids=_ints(part.gpu_ids),
                cpu_block_ids=_ints(part.cpu_ids),
                keys=tuple(part.keys or ()),
                req_id=part.req_id,
                batch_seq=batch_seq,
                future_done=future.done(),
                future_cancelled=future.cancelled(),
                abandoned=_abandoned(future),
            )
        ]
    gpu, cpu, keys = _ints(part.gpu_ids), _ints(part.cpu_ids), part.keys or []
    swaps, start = [], 0
    ends = future.ends if future.ends is not None else range(1, len(keys) + 1)
    for call, end in zip(future.calls(), ends):
        swaps.append(
            SwapSnapshot(
                "store",
                part.direction,
                gpu[start:end],
                cpu[start:end],
                tuple(keys[start:end]),
                None,
                batch_seq,
                call.done(),
                call.cancelled(),
                _abandoned(call),
            )
        )
        start = end
    return swaps


def _side_swaps(
    promoting: Sequence[tuple[list[bytes], np.ndarray]], waiting: Sequence[WaitingStore]
) -> list[SwapSnapshot]:
    """The promotes from lower tiers in flight and the stores waiting for room, as swaps."""
    swaps = [
        SwapSnapshot(
            "promote", Direction.H2D, (), _ints(ids), tuple(keys), None, None, False, False
        )
        for keys, ids in promoting
    ]
    return swaps + [
        SwapSnapshot(
            "waiting",
            Direction.D2H,
            _ints(w.gpu_ids),
            (),
            tuple(w.keys),
            None,
            None,
            w.future.done(),
            w.future.cancelled(),
        )
        for w in waiting
    ]


def _batch(
    batch: Batch,
    queue: SwapQueue,
    engine_batches: Callable[[int], tuple[int | None, tuple[int, ...]]],
) -> BatchSnapshot:
    """One batch in flight, with its engine batch and the engine batches it waits for."""
    engine_waits = tuple(
        e
        for s in batch.wait_for
        if s in queue.in_flight and (e := engine_batches(s)[0]) is not None
    )
    engine_id, engine_ids = engine_batches(batch.seq)
    return BatchSnapshot(
        batch.seq,
        batch.direction,
        engine_id,
        _ints(batch.gpu_ids),
        batch.wait_for,
        engine_waits,
        engine_ids,
    )


def take_snapshot(
    books: Bookkeeper,
    queue: SwapQueue,
    promoting: Sequence[tuple[list[bytes], np.ndarray]] = (),
    waiting: Sequence[WaitingStore] = (),
    engine_batches: Callable[[int], tuple[int | None, tuple[int, ...]]] = lambda seq: (None, ()),
) -> ManagerSnapshot:
    """Build the snapshot of a manager's bookkeeper and queue (and the promotes from lower
    tiers in flight, shown as swaps of kind ``"promote"``, and the stores waiting for room,
    of kind ``"waiting"``). ``engine_batches`` maps a job id to the local engine's batch id and
    every engine batch it joins (``(None, ())`` where the job runs on other processes)."""
    cpu, gpu = books.cpu, books.gpu
    keys = {
        key: KeySnapshot(block, CpuState(cpu.state[block]), int(cpu.readers[block]))
        for key, block in cpu.index.items()
    }
    swaps = [s for p in queue.queued_parts() for s in _swaps(p, None)]
    swaps += _side_swaps(promoting, waiting)
    in_flight = list(queue.in_flight.values())
    swaps += [s for b in in_flight for p in b.lane.parts for s in _swaps(p, b.seq)]
    batches = [_batch(b, queue, engine_batches) for b in in_flight]
    pool = gpu.pool
    allocated = None if pool is None else frozenset(np.flatnonzero(pool.allocated_mask()).tolist())
    return ManagerSnapshot(
        keys=keys,
        policy_keys=frozenset(k for k in cpu.index if k in cpu.policy),
        num_policy_keys=len(cpu.policy),
        cpu_states=tuple(CpuState(s) for s in cpu.state),
        cpu_allocated=frozenset(np.flatnonzero(cpu.pool.allocated_mask()).tolist()),
        gpu_states=None if pool is None else tuple(GpuState(s) for s in gpu.state),
        gpu_allocated=allocated,
        gpu_busy={int(b): int(gpu.busy_np[b]) for b in np.flatnonzero(gpu.busy_np)},
        tables={
            req: TableSnapshot(req, t.tier, tuple(t.block_ids), t.gpu_owned, t.moving)
            for req, t in books.requests.tables.items()
        },
        swaps=tuple(swaps),
        batches=tuple(batches),
        key_parents=dict(cpu.chains.parent),
    )
