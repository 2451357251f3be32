"""The manager's side of layerwise loads and stores: a reserved part -> per-group batches.

Private to ``kvmgr.manager`` (the handles and their contract: ``kvmgr.transfer.layerwise``).
A layerwise operation is one ``Part`` (reserved by the bookkeeper like ``load_many`` /
``store_many``) in a lane of its own, submitted as one batch per layer group. It enters the
swap queue's in-flight batches as ONE ``Batch`` whose handle is ``LayerBatches.handle``, so
completion, rollback, fences of later batches and ``close`` treat it like any other batch: the
bookkeeping runs once, after every group ended.

Ordering: what is queued when the operation starts is flushed first (one ``Flusher.flush``),
so the groups are fenced on it like any later batch; a load's groups are all submitted before
``start_load`` returns. A store's batch has no end event until its last layer is saved: a load
queued meanwhile into one of its GPU blocks is refused at ``step()`` (it cannot be ordered).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np

from kvmgr.errors import StaleKVTensorError
from kvmgr.manager.flush import Flusher
from kvmgr.manager.queue import Batch, Lane, Part
from kvmgr.transfer.engine import BatchHandle
from kvmgr.transfer.layer_groups import LayerGroups, sub_layout
from kvmgr.transfer.layerwise import LayerBatches, LayerwiseLoad, LayerwiseStore
from kvmgr.transfer.plan import Direction, build_plan

__all__ = ["start_load", "start_store"]


def _launch(flusher: Flusher, lane: Lane, batches: LayerBatches) -> Batch:
    """Enter the operation as one in-flight batch; its completion runs on the loop thread."""
    queue = flusher.queue
    gpu_ids, cpu_ids = lane.arrays()
    batch = Batch(queue.next_seq(), lane, gpu_ids, cpu_ids, batches.handle, time.perf_counter(), ())
    queue.launched(batch)
    loop = flusher.loop
    assert loop is not None

    def on_done(_: object) -> None:  # an engine thread, or here if already done
        with contextlib.suppress(RuntimeError):  # loop closed: close() settles the batch
            loop.call_soon_threadsafe(flusher.complete_batch, batch)

    batches.handle.future.add_done_callback(on_done)
    return batch


def _group_submit(
    flusher: Flusher, direction: Direction, tensors: np.ndarray, gpu_ids: np.ndarray,
    cpu_ids: np.ndarray, moved: str | None,
) -> Callable[[], BatchHandle]:  # fmt: skip
    """``submit()`` of one group: its plan over the group's tensors, fenced on the in-flight
    batches of the other direction that share its GPU blocks."""

    def submit() -> BatchHandle:
        if moved is not None:
            raise StaleKVTensorError(moved)
        books = flusher.books
        gpu = sub_layout(books.gpu_layout, tensors)
        cpu = sub_layout(books.cpu_pool.layout, tensors)
        if direction is Direction.H2D:
            plan = build_plan(direction, cpu, gpu, cpu_ids, gpu_ids, merge=books.config.merge)
        else:
            plan = build_plan(direction, gpu, cpu, gpu_ids, cpu_ids, merge=books.config.merge)
        fences = [b.handle for b in flusher.queue.fences(direction, gpu_ids)]
        return flusher.engine.submit(plan, wait_for=fences)

    return submit


def start_load(
    flusher: Flusher, groups: LayerGroups, part: Part, is_open: Callable[[], bool]
) -> LayerwiseLoad:
    """Flush what is queued, then submit the load's groups in layer order; the handle."""
    flusher.flush()
    lane = Lane(Direction.H2D)
    lane.add(part)
    gpu_ids, cpu_ids = lane.arrays()
    batches = LayerBatches(Direction.H2D, groups.num_groups)
    moved = flusher._moved_tensor()
    for group, tensors in enumerate(groups.tensors):
        submit = _group_submit(flusher, Direction.H2D, tensors, gpu_ids, cpu_ids, moved)
        if batches.submit(group, submit) is None:
            break
    batches.close()
    _launch(flusher, lane, batches)
    return LayerwiseLoad(flusher.engine, groups, batches, part.future, is_open)


def start_store(
    flusher: Flusher, groups: LayerGroups, part: Part, is_open: Callable[[], bool]
) -> LayerwiseStore:
    """Flush what is queued and enter the store as in flight; its groups are submitted by
    ``save_layer``."""
    flusher.flush()
    lane = Lane(Direction.D2H)
    lane.add(part)
    gpu_ids, cpu_ids = lane.arrays()
    batches = LayerBatches(Direction.D2H, groups.num_groups)
    _launch(flusher, lane, batches)
    moved = flusher._moved_tensor()

    def submit_group(group: int) -> BatchHandle:
        tensors = groups.tensors[group]
        return _group_submit(flusher, Direction.D2H, tensors, gpu_ids, cpu_ids, moved)()

    return LayerwiseStore(groups, batches, part.future, submit_group, is_open)
