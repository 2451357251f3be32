"""The one place that builds the parts of a manager and connects them.

Private to ``kvmgr.manager``. ``build_local`` makes, in order: the rank's ``TransferWorker``
(KV tensors, CPU-tier memory, engine), the ``Scheduler`` (bookkeeping and queue, told how far
the memory is pinned), the stores waiting for room, the lower tiers, and the ``Flusher`` with
its transport (``LocalTransport``: plain calls to the worker, outcomes delivered to
``Flusher.complete``). ``build_ranked`` makes the scheduler side over a group of rank
processes (``RankTransport``). Nothing is assigned to a part after it was built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import ConfigError, GeometryError, HostMemoryError, TransferError
from kvmgr.manager.backpressure import RoomWaiters
from kvmgr.manager.flush import Flusher
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler import Scheduler
from kvmgr.scheduler.queue import Part
from kvmgr.transfer import make_engine
from kvmgr.transfer.engine import TransferEngine
from kvmgr.transfer.host import HostEngine
from kvmgr.transport.local import LocalTransport
from kvmgr.worker import TransferWorker

__all__ = ["Parts", "build_local", "build_ranked"]


@attrs.frozen(eq=False)
class Parts:
    """A manager's parts, connected.

    Attributes:
        scheduler: bookkeeping and queue (no tensors).
        flusher: jobs out through ``flusher.transport``, outcomes in.
        room: stores waiting for room.
        tiers: ``LowerTiers`` or ``None``.
        worker: the in-process worker, or ``None`` when the workers are other processes.
    """

    scheduler: Scheduler
    flusher: Flusher
    room: RoomWaiters
    tiers: Any
    worker: TransferWorker | None


def build_local(
    gpu_kv_caches: Sequence[torch.Tensor],
    config: ManagerConfig,
    engine: TransferEngine | None,
    tiers: Sequence[Any],
    tier_namespace: Any,
    enqueue: Callable[[Part], None],
) -> Parts:
    """One process, one rank: worker, scheduler, waiting stores, lower tiers, flusher.

    Raises:
        GeometryError: ``gpu_kv_caches`` is not a sequence of tensors (checked before anything
            is built), or the tensors cannot be managed, or do not suit the engine's device.
        ConfigError: a lower tier is not a ``TierBackend``.
        HostMemoryError: the CPU tier's memory could not be allocated.
    """
    tensors = _kv_tensors(gpu_kv_caches)
    device = KVLayout.from_tensors(tensors).device
    _check_parts(engine, tiers, tier_namespace)
    if engine is None:
        engine = make_engine(config.engine, device, config)
    elif isinstance(engine, HostEngine) and device.type != "cpu":
        raise GeometryError(f"the host engine needs CPU tensors, got {device}")
    worker = _worker(tensors, config, engine)
    scheduler = Scheduler(
        config,
        worker.geometry,
        worker.blocks_ready if worker.is_pinning else None,
        keep_evicted=bool(tiers) and config.tier_write_back,
    )
    books = scheduler.books
    room = RoomWaiters(books.gpu, books.counters, enqueue, books.settle_deferred)
    lower = _lower_tiers(scheduler, worker, tensors, tiers, tier_namespace, config)
    flusher = Flusher(scheduler, room, lower, lambda deliver: LocalTransport(worker, deliver))
    return Parts(scheduler, flusher, room, lower, worker)


def _kv_tensors(gpu_kv_caches: object) -> list[torch.Tensor]:
    """``gpu_kv_caches`` as a new list; ``GeometryError`` unless it is a sequence (a list or a
    tuple) of tensors: a single tensor would be split along dim 0 into one "layer" per block,
    a dict would give its keys, a generator could not be read twice."""
    if isinstance(gpu_kv_caches, (torch.Tensor, str, bytes)) or not isinstance(
        gpu_kv_caches, Sequence
    ):
        hint = " (one tensor: pass [tensor])" if isinstance(gpu_kv_caches, torch.Tensor) else ""
        raise GeometryError(
            "gpu_kv_caches: expected a sequence of KV tensors (a list with one tensor per "
            f"layer, or per layer and K/V), got {type(gpu_kv_caches).__name__}{hint}"
        )
    return list(gpu_kv_caches)  # KVLayout.from_tensors checks each is a tensor


def _check_parts(engine: Any, tiers: Sequence[Any], tier_namespace: Any) -> None:
    """``ConfigError`` for an engine, a lower tier or a namespace of the wrong type (the
    tiers package is imported only when tiers or a namespace are given)."""
    for tier in tiers:
        from kvmgr.tiers.base import TierBackend

        if not isinstance(tier, TierBackend):
            raise ConfigError(f"expected a TierBackend, got {type(tier).__name__}")
    if engine is not None and not isinstance(engine, TransferEngine):
        raise ConfigError(f"engine: expected a TransferEngine, got {type(engine).__name__}")
    if tier_namespace is None:
        return
    from kvmgr.tiers.blob import TierNamespace

    if not isinstance(tier_namespace, TierNamespace):
        raise ConfigError(
            f"tier_namespace: expected a kvmgr.tiers.TierNamespace or None, got "
            f"{type(tier_namespace).__name__}"
        )


def _worker(
    tensors: list[torch.Tensor], config: ManagerConfig, engine: TransferEngine
) -> TransferWorker:
    """The rank's worker; ``HostMemoryError`` (the engine closed) when its CPU tier's memory
    cannot be allocated."""
    try:
        return TransferWorker(tensors, config.num_cpu_blocks, engine, merge=config.merge)
    except (TransferError, MemoryError) as exc:  # the region, or the CPU tier's arrays
        engine.close(0)
        block_bytes = KVLayout.from_tensors(tensors).block_bytes
        num_bytes = config.num_cpu_blocks * block_bytes
        raise HostMemoryError(
            f"could not allocate the CPU tier: num_cpu_blocks={config.num_cpu_blocks} x "
            f"{block_bytes} B = {num_bytes} B ({exc or type(exc).__name__})",
            num_bytes=num_bytes,
        ) from exc


def _lower_tiers(
    scheduler: Scheduler,
    worker: TransferWorker,
    tensors: list[torch.Tensor],
    tiers: Sequence[Any],
    namespace: Any,
    config: ManagerConfig,
) -> Any:
    if not tiers:
        return None
    from kvmgr.manager.lower_tiers import LowerTiers, default_namespace

    books = scheduler.books
    if namespace is None:
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
        block_size = int(tensors[0].shape[1]) if tensors[0].dim() > 1 else 1
        namespace = default_namespace(books, dtypes, block_size)
    return LowerTiers(
        books,
        worker.cpu_pool.tensors,
        tiers,
        namespace,
        write_back=config.tier_write_back,
        write_through=config.tier_write_through,
    )


def build_ranked(group: Any, config: ManagerConfig, enqueue: Callable[[Part], None]) -> Parts:
    """The scheduler side over a ``kvmgr.transport.RankGroup``: no local worker, no tensors
    (each rank allocates its own CPU-tier memory; lower tiers are not supported over ranks)."""
    scheduler = Scheduler(config, group.geometry)
    books = scheduler.books
    room = RoomWaiters(books.gpu, books.counters, enqueue, books.settle_deferred)
    flusher = Flusher(scheduler, room, None, group.connect)
    return Parts(scheduler, flusher, room, None, None)
