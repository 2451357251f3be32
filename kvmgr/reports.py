"""Value objects the manager returns: per swap, per batched call, per step, and running totals.

Offers:
    SwapResult          what one per-call swap (``swap_out``/``swap_in``/``preempt``/``resume``) moved
    StoreResult         what one ``store_many`` call did, as arrays (one entry per key)
    LoadResult          what one ``load_many`` call moved
    DirectionReport     one direction's batches in one step
    StepReport          what one ``step()`` did
    KVEvent             one entry of the KV event stream (``stored`` / ``removed`` / ``cleared``)
    Histogram           fixed-bucket counts (batch sizes, completion latency)
    ManagerStatistics   totals since the manager was created (counters only grow) and gauges

Results of the batched API hold numpy arrays and no per-key Python objects, so a step of many
blocks keeps a constant number of objects alive.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import attrs
import numpy as np

from kvmgr.hooks import HookReport

if TYPE_CHECKING:  # the scheduler side builds these results and imports no torch
    from kvmgr.transfer.engine import BatchResult
    from kvmgr.transfer.pinning import PinStatistics

__all__ = [
    "DirectionReport",
    "Histogram",
    "KVEvent",
    "LoadResult",
    "ManagerStatistics",
    "StepReport",
    "StoreResult",
    "SwapResult",
]


class SwapResult(NamedTuple):
    """One completed per-call swap. Every field has one meaning whatever the swap.

    Attributes:
        num_blocks: blocks copied.
        num_bytes: bytes copied (``num_blocks`` x bytes per block).
        num_skipped: keys of a store not copied: already in the CPU tier, or not admitted
            (``store_threshold``); 0 for other swaps.
        cpu_block_ids: CPU blocks written (store, preempt) or read (load, resume), in call order.
        gpu_block_ids: GPU blocks read (store, preempt) or written (load, resume), in call order;
            for a preempt these are the GPU blocks it gave back.
    """

    num_blocks: int
    num_bytes: int
    num_skipped: int = 0
    cpu_block_ids: tuple[int, ...] = ()
    gpu_block_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True, eq=False)
class StoreResult:
    """One ``store_many`` call, one entry per key of the call (arrays of length ``n``).

    Attributes:
        stored: bool ``[n]``: the key was copied into the CPU tier by this call.
        present: bool ``[n]``: the key was already in the CPU tier (PENDING or READY); not copied.
        cpu_block_ids: int64 ``[n]``: the CPU block written, ``-1`` where not stored.
        num_bytes: bytes copied.
    """

    stored: np.ndarray
    present: np.ndarray
    cpu_block_ids: np.ndarray
    num_bytes: int

    @property
    def num_stored(self) -> int:
        """Keys copied."""
        return int(np.count_nonzero(self.stored))

    @property
    def num_skipped(self) -> int:
        """Keys not copied (present, or not admitted)."""
        return len(self.stored) - self.num_stored


@attrs.frozen(kw_only=True, eq=False)
class LoadResult:
    """One ``load_many`` call.

    Attributes:
        gpu_block_ids: int64 ``[n]``: the GPU blocks written, in call order.
        cpu_block_ids: int64 ``[n]``: the CPU blocks read, in call order.
        num_bytes: bytes copied.
    """

    gpu_block_ids: np.ndarray
    cpu_block_ids: np.ndarray
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        """Blocks copied."""
        return len(self.gpu_block_ids)


@attrs.frozen(kw_only=True)
class DirectionReport:
    """What one step submitted in one direction.

    Attributes:
        swaps: swap calls flushed (a ``store_many`` call counts once).
        blocks: blocks to copy.
        pages: pages (blocks x tensors): descriptors before merging.
        descriptors: descriptors after merging.
        bytes: bytes to copy.
        batches: plans submitted (1, or more when a hazard forced ordered batches).
    """

    swaps: int = 0
    blocks: int = 0
    pages: int = 0
    descriptors: int = 0
    bytes: int = 0
    batches: int = 0

    def __add__(self, other: DirectionReport) -> DirectionReport:
        return DirectionReport(
            swaps=self.swaps + other.swaps,
            blocks=self.blocks + other.blocks,
            pages=self.pages + other.pages,
            descriptors=self.descriptors + other.descriptors,
            bytes=self.bytes + other.bytes,
            batches=self.batches + other.batches,
        )


@attrs.frozen(kw_only=True)
class StepReport:
    """What one ``OffloadManager.step()`` did.

    Attributes:
        step: step number.
        d2h: stores and preempts submitted (GPU -> CPU).
        h2d: loads and resumes submitted (CPU -> GPU).
        hooks: one report per hook, in run order.
        completed: batches that completed since the previous step, with bytes and device seconds.
        host_s: host seconds spent inside ``step()`` (hooks, planning, submission).
    """

    step: int
    d2h: DirectionReport
    h2d: DirectionReport
    hooks: tuple[HookReport, ...] = ()
    completed: tuple[BatchResult, ...] = ()
    host_s: float = 0.0


@attrs.frozen
class KVEvent:
    """One change of what a tier holds, for a KV-aware router or an external index.

    Attributes:
        kind: ``"stored"`` (the keys became READY in ``tier``: their copy has landed),
            ``"removed"`` (they left it: evicted, invalidated, cleared; emitted before the
            block is reused) or ``"cleared"`` (the manager closed: it serves nothing any more,
            in any tier; ``keys`` is empty and ``tier`` is ``"all"``).
        keys: the keys, in the order of the call that caused the event.
        tier: ``"cpu"`` (lower tiers name themselves), ``"all"`` for ``"cleared"``.
        parents: ``stored`` events of the CPU tier: ``parents[i]`` is the key ``keys[i]``
            extends (``None``: a root), as the store gave it (by default each key of a call
            extends the previous one); ``None`` where unknown (lower tiers, promotions).
        token_ids: ``stored`` events whose stores passed ``token_ids``: int32
            ``[len(keys), block_size]``, row ``i`` the tokens of ``keys[i]`` (read it, do not
            write it); ``None`` otherwise.

    ``parents`` and ``token_ids`` are detail for routers: they take no part in ``==``.
    """

    kind: str
    keys: tuple[bytes, ...]
    tier: str = "cpu"
    parents: tuple[bytes | None, ...] | None = attrs.field(default=None, eq=False)
    token_ids: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Histogram:
    """Counts in fixed buckets (Prometheus style: ``counts[i]`` = observations <= ``bounds[i]``
    and > ``bounds[i-1]``; the last count is the overflow above ``bounds[-1]``).

    Attributes:
        bounds: upper bounds of the buckets, increasing (units as the field says).
        counts: ``len(bounds) + 1`` counts.
        total: sum of the observations.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def num(self) -> int:
        """Observations."""
        return sum(self.counts)


@attrs.frozen(kw_only=True)
class ManagerStatistics:
    """Totals since the manager was created (every counter only grows), plus gauges.

    Counters:
        lookups: ``lookup`` calls. lookup_keys / lookup_hits: keys asked / READY prefix hits.
        peeks: ``peek`` calls (they touch nothing and are not in lookup_*).
        stores_queued / stores_completed / stores_failed: blocks stored (stores + preempts).
        stores_skipped: store keys already in the CPU tier, not copied.
        stores_not_admitted: store keys seen fewer than ``store_threshold`` times, not copied.
        loads_queued / loads_completed / loads_failed: blocks loaded (loads + resumes).
        evictions: CPU blocks evicted by the policy. invalidated: keys dropped by
            ``invalidate``/``clear``.
        rejected: calls refused, by reason (``"cpu_full"``, ``"cpu_pinning"``, ``"gpu_full"``,
            ``"timeout"``).
        await_timeouts: ``wait()`` calls that passed their deadline.
        events_dropped: KV events lost because nobody drained the bounded stream.
        bytes_d2h / bytes_h2d: bytes of completed batches. device_s_d2h / device_s_h2d: their
            device seconds.
        steps: ``step()`` calls.
        batch_blocks: histogram of blocks per submitted batch.
        completion_s: histogram of seconds from submission to completion per batch.
    Gauges:
        batches_in_flight: batches submitted and not completed. queued_swaps: swaps not flushed.
        stores_waiting: stores waiting for room (``backpressure="wait"``), not in queued_swaps.
        cpu_blocks_used / cpu_blocks_total: CPU tier occupancy (keyed + request blocks).
        cpu_blocks_ready: CPU blocks whose memory is usable (page-locked) now; below
            ``cpu_blocks_total`` while the engine pins the tier in the background (stores that
            find no room then fail with reason ``"cpu_pinning"``), or after a piece failed.
        cpu_pinning: how the CPU tier was page-locked (``PinStatistics``: bytes, pieces,
            seconds per phase, ``pin_s`` in total, an error), or ``None`` for engines that do
            not pin (host engine).
        cpu_keys_pending / cpu_keys_ready: keyed blocks by state; cpu_keys_loading: READY keys
            with loads in flight (a subset of cpu_keys_ready).
        gpu_blocks_free: free blocks of the owned GPU pool (``None`` when not owned).
        policy: eviction policy name. engine: engine name.
    """

    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    peeks: int = 0
    stores_queued: int = 0
    stores_completed: int = 0
    stores_failed: int = 0
    stores_skipped: int = 0
    stores_not_admitted: int = 0
    loads_queued: int = 0
    loads_completed: int = 0
    loads_failed: int = 0
    evictions: int = 0
    invalidated: int = 0
    rejected: Mapping[str, int] = attrs.field(factory=dict)
    await_timeouts: int = 0
    events_dropped: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    device_s_d2h: float = 0.0
    device_s_h2d: float = 0.0
    steps: int = 0
    batch_blocks: Histogram | None = None
    completion_s: Histogram | None = None
    batches_in_flight: int = 0
    queued_swaps: int = 0
    stores_waiting: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_total: int = 0
    cpu_blocks_ready: int = 0
    cpu_pinning: PinStatistics | None = None
    cpu_keys_pending: int = 0
    cpu_keys_ready: int = 0
    cpu_keys_loading: int = 0
    gpu_blocks_free: int | None = None
    policy: str = ""
    engine: str = ""
