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
``start_load`` returns. A store's batch has no end event until its last layer is saved (not the
last group submitted so far: a fence on that would let a load overwrite blocks the store has
yet to read): on every engine, a load queued meanwhile into one of its GPU blocks fails at
``step()`` with ``TransferError`` (it cannot be ordered); the step itself does not raise.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Hashable, Sequence

import attrs
import numpy as np

from kvmgr.errors import StaleKVTensorError
from kvmgr.manager.flush import Flusher
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler.jobs import Direction
from kvmgr.scheduler.queue import Lane, Part
from kvmgr.transfer.engine import BatchHandle, check_orderable
from kvmgr.transfer.layer_groups import LayerGroups, dense_tensors, group_plan, sub_layout
from kvmgr.transfer.layerwise import LayerBatches, LayerwiseLoad, LayerwiseStore
from kvmgr.transfer.plan import BlockPairs, build_plan
from kvmgr.worker import TransferWorker

__all__ = ["GroupLayouts", "LayerLayouts", "start_load", "start_store"]

#: per group: its GPU and CPU sub-layouts and how many of its tensors are dense on both sides
GroupLayouts = tuple[tuple[KVLayout, KVLayout, int], ...]


@attrs.define(eq=False)
class LayerLayouts:
    """Layer groups and the GPU and CPU sub-layouts of each group's tensors, made once per
    grouping: the copy kernel keeps one device table per layout pair (``CopyStager``), keyed by
    the layout objects, so a new pair per load would upload (and allocate) a table every time;
    and grouping the layers again per load cost host time for nothing."""

    _pairs: dict[bytes, tuple[KVLayout, KVLayout]] = attrs.field(factory=dict, init=False)
    _groups: dict[Hashable, tuple[LayerGroups, GroupLayouts]] = attrs.field(
        factory=dict, init=False
    )

    def groups(
        self,
        worker: TransferWorker,
        layers: Sequence[int] | int | None,
        min_group_bytes: int,
        max_groups: int | None,
    ) -> tuple[LayerGroups, GroupLayouts]:
        """``LayerGroups.build`` over the worker's tensors (cached by its arguments) and each
        group's ``(gpu, cpu, tensors dense on both sides)``.

        Raises:
            LayerOrderError: as ``LayerGroups.build``.
        """
        try:
            layer_key = layers if layers is None or isinstance(layers, int) else tuple(layers)
            # with the types: 2.0 == 2 and True == 1, but only ints pass LayerGroups.build
            types = tuple(map(type, layer_key)) if type(layer_key) is tuple else type(layer_key)
            key: Hashable = (layer_key, types, min_group_bytes, type(min_group_bytes), max_groups, type(max_groups))  # fmt: skip
            hash(key)
        except TypeError:  # odd input: build (and let it raise) without caching
            key = None
        cached = self._groups.get(key) if key is not None else None
        if cached is None:
            page_bytes = worker.gpu_layout.page_bytes.tolist()
            groups = LayerGroups.build(page_bytes, layers, min_group_bytes, max_groups)
            pairs = [self.get(worker, t) for t in groups.tensors]
            cached = (groups, tuple((g, c, dense_tensors(g, c)) for g, c in pairs))
            if key is not None and len(self._groups) < 64:
                self._groups[key] = cached
        return cached

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


class _GroupSubmits:
    """``submit(group)`` of an operation's groups: the whole operation's plan is built (and its
    ids checked) once, at the first group, and each group's plan is its block pairs over the
    group's sub-layouts (``group_plan``); fenced on the in-flight jobs of the other direction
    that share its GPU blocks (found once for a load, whose groups all go out together; per
    group for a store, as it goes)."""

    def __init__(
        self, flusher: Flusher, worker: TransferWorker, direction: Direction,
        layouts: GroupLayouts, gpu_ids: np.ndarray, cpu_ids: np.ndarray, *, fence_once: bool,
    ) -> None:  # fmt: skip
        self._flusher, self._worker, self._direction = flusher, worker, direction
        self._layouts, self._gpu_ids, self._cpu_ids = layouts, gpu_ids, cpu_ids
        self._moved = worker.moved()
        self._fence_once = fence_once
        self._pairs: BlockPairs | None = None
        self._built = False
        self._fences: list[BatchHandle] | None = None

    def __call__(self, group: int) -> BatchHandle:
        if self._moved is not None:
            raise StaleKVTensorError(self._moved)
        worker, direction = self._worker, self._direction
        if not self._built:
            gpu, cpu = worker.gpu_layout, worker.cpu_pool.layout
            if direction is Direction.H2D:
                whole = build_plan(direction, cpu, gpu, self._cpu_ids, self._gpu_ids, merge=worker.merge)  # fmt: skip
            else:
                whole = build_plan(direction, gpu, cpu, self._gpu_ids, self._cpu_ids, merge=worker.merge)  # fmt: skip
            self._pairs, self._built = whole.blocks, True
        gpu, cpu, dense = self._layouts[group]
        if direction is Direction.H2D:
            plan = group_plan(direction, self._pairs, cpu, gpu, dense)
        else:
            plan = group_plan(direction, self._pairs, gpu, cpu, dense)
        fences = self._fences
        if fences is None:
            in_flight = self._flusher.scheduler.queue.fences(direction, self._gpu_ids)
            fences = [h for b in in_flight if (h := worker.handle(b.seq)) is not None]
            if self._fence_once:
                self._fences = fences
        check_orderable(fences, direction)  # a load into an open layerwise store's blocks
        return worker.engine.submit(plan, wait_for=fences)


def start_load(
    flusher: Flusher,
    worker: TransferWorker,
    loop: asyncio.AbstractEventLoop,
    layouts: GroupLayouts,
    groups: LayerGroups,
    part: Part,
    is_open: Callable[[], bool],
) -> LayerwiseLoad:
    """Flush what is queued, then submit the load's groups in layer order; the handle."""
    lane, batches, ids = _begin(flusher, loop, Direction.H2D, part, groups.num_groups)
    submits = _GroupSubmits(flusher, worker, Direction.H2D, layouts, *ids, fence_once=True)
    for group in range(groups.num_groups):
        if batches.submit(group, functools.partial(submits, group)) is None:
            break
    batches.close()
    _launch(flusher, lane, batches, loop)
    return LayerwiseLoad(worker.engine, groups, batches, part.future, is_open)


def start_store(
    flusher: Flusher,
    worker: TransferWorker,
    loop: asyncio.AbstractEventLoop,
    layouts: GroupLayouts,
    groups: LayerGroups,
    part: Part,
    is_open: Callable[[], bool],
) -> LayerwiseStore:
    """Flush what is queued and enter the store as in flight; its groups are submitted by
    ``save_layer``."""
    lane, batches, ids = _begin(flusher, loop, Direction.D2H, part, groups.num_groups)
    _launch(flusher, lane, batches, loop)
    submit_group = _GroupSubmits(flusher, worker, Direction.D2H, layouts, *ids, fence_once=False)
    return LayerwiseStore(groups, batches, part.future, submit_group, is_open)


def _begin(
    flusher: Flusher, loop: asyncio.AbstractEventLoop, direction: Direction, part: Part, num: int
) -> tuple[Lane, LayerBatches, tuple[np.ndarray, np.ndarray]]:
    """Flush what is queued; the part's lane, its ``num`` layer batches, its (GPU, CPU) ids.
    The blocks the part's store evicted are staged for write-back first (the flush stages
    only with work queued): its groups overwrite those CPU blocks, and the lower tier would
    get their bytes under the evicted keys, valid checksums and all."""
    flusher.flush(loop)
    if flusher.tiers is not None:
        flusher.tiers.write_evicted(flusher.scheduler.books.take_evicted(), loop)
    lane = Lane(direction)
    lane.add(part)
    return lane, LayerBatches(direction, num), lane.arrays()
