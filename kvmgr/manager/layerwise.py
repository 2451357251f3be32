"""The manager's side of layerwise loads and stores: a reserved part -> per-group batches.

Private to ``kvmgr.manager`` (the handles and their contract: ``kvmgr.transfer.layerwise``).
A layerwise operation is one ``Part`` (reserved by the bookkeeper like ``load_many`` /
``store_many``) in a lane of its own, launched as ONE job of the scheduler and submitted by the
in-process worker as one batch per layer group. The local transport tracks the job's handle
(``LayerBatches.handle``), so completion, rollback, fences of later jobs and ``close`` treat it
like any other job: the bookkeeping runs once, after every group ended. Layerwise copies need
the in-process worker (not supported over ranks).

Ordering: what is queued when the operation starts is flushed first (one ``Flusher.flush``),
so the groups are fenced on it like any later batch; a load's groups are all submitted before
``start_load`` returns. A store's batch has no end event until its last layer is saved: a load
queued meanwhile into one of its GPU blocks is refused at ``step()`` (it cannot be ordered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from kvmgr.errors import StaleKVTensorError
from kvmgr.manager.flush import Flusher
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler.jobs import Direction
from kvmgr.scheduler.queue import Lane, Part
from kvmgr.transfer.engine import BatchHandle
from kvmgr.transfer.layer_groups import LayerGroups, sub_layout
from kvmgr.transfer.layerwise import LayerBatches, LayerwiseLoad, LayerwiseStore
from kvmgr.transfer.plan import build_plan
from kvmgr.worker import TransferWorker

__all__ = ["LayerLayouts", "start_load", "start_store"]


class LayerLayouts:
    """The GPU and CPU sub-layouts of each group's tensors, made once per tensor set: the copy
    kernel keeps one device table per layout pair (``CopyStager``), keyed by the layout objects,
    so a new pair per load would upload (and allocate) a table every time."""

    def __init__(self) -> None:
        self._pairs: dict[bytes, tuple[KVLayout, KVLayout]] = {}

    def get(self, worker: TransferWorker, tensors: np.ndarray) -> tuple[KVLayout, KVLayout]:
        """``(gpu, cpu)`` layouts of ``tensors`` (int64 tensor indices) on ``worker``."""
        key = tensors.tobytes()
        pair = self._pairs.get(key)
        if pair is None:
            pair = (
                sub_layout(worker.gpu_layout, tensors),
                sub_layout(worker.cpu_pool.layout, tensors),
            )
            self._pairs[key] = pair
        return pair


def _launch(
    flusher: Flusher, lane: Lane, batches: LayerBatches, loop: asyncio.AbstractEventLoop
) -> None:
    """Enter the operation as one in-flight job; its completion runs on the loop thread."""
    job = flusher.scheduler.launch(lane, fenced=False)  # each group is fenced at its submit
    flusher.transport.track(job.job_id, batches.handle, loop)


def _group_submit(
    flusher: Flusher, worker: TransferWorker, layouts: LayerLayouts, direction: Direction,
    tensors: np.ndarray,
    gpu_ids: np.ndarray, cpu_ids: np.ndarray, moved: str | None,
) -> Callable[[], BatchHandle]:  # fmt: skip
    """``submit()`` of one group: its plan over the group's tensors, fenced on the in-flight
    jobs of the other direction that share its GPU blocks."""

    def submit() -> BatchHandle:
        if moved is not None:
            raise StaleKVTensorError(moved)
        gpu, cpu = layouts.get(worker, tensors)
        if direction is Direction.H2D:
            plan = build_plan(direction, cpu, gpu, cpu_ids, gpu_ids, merge=worker.merge)
        else:
            plan = build_plan(direction, gpu, cpu, gpu_ids, cpu_ids, merge=worker.merge)
        in_flight = flusher.scheduler.queue.fences(direction, gpu_ids)
        fences = [h for b in in_flight if (h := worker.handle(b.seq)) is not None]
        return worker.engine.submit(plan, wait_for=fences)

    return submit


def start_load(
    flusher: Flusher,
    worker: TransferWorker,
    loop: asyncio.AbstractEventLoop,
    layouts: LayerLayouts,
    groups: LayerGroups,
    part: Part,
    is_open: Callable[[], bool],
) -> LayerwiseLoad:
    """Flush what is queued, then submit the load's groups in layer order; the handle."""
    flusher.flush(loop)
    lane = Lane(Direction.H2D)
    lane.add(part)
    gpu_ids, cpu_ids = lane.arrays()
    batches = LayerBatches(Direction.H2D, groups.num_groups)
    moved = worker.moved()
    for group, tensors in enumerate(groups.tensors):
        submit = _group_submit(
            flusher, worker, layouts, Direction.H2D, tensors, gpu_ids, cpu_ids, moved
        )
        if batches.submit(group, submit) is None:
            break
    batches.close()
    _launch(flusher, lane, batches, loop)
    return LayerwiseLoad(worker.engine, groups, batches, part.future, is_open)


def start_store(
    flusher: Flusher,
    worker: TransferWorker,
    loop: asyncio.AbstractEventLoop,
    layouts: LayerLayouts,
    groups: LayerGroups,
    part: Part,
    is_open: Callable[[], bool],
) -> LayerwiseStore:
    """Flush what is queued and enter the store as in flight; its groups are submitted by
    ``save_layer``."""
    flusher.flush(loop)
    lane = Lane(Direction.D2H)
    lane.add(part)
    gpu_ids, cpu_ids = lane.arrays()
    batches = LayerBatches(Direction.D2H, groups.num_groups)
    _launch(flusher, lane, batches, loop)
    moved = worker.moved()

    def submit_group(group: int) -> BatchHandle:
        tensors = groups.tensors[group]
        submit = _group_submit(
            flusher, worker, layouts, Direction.D2H, tensors, gpu_ids, cpu_ids, moved
        )
        return submit()

    return LayerwiseStore(groups, batches, part.future, submit_group, is_open)
