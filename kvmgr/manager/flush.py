"""Flush and completion: queued lanes -> plans -> engine batches -> bookkeeping -> futures.

Private to ``kvmgr.manager``. ``Flusher.flush`` takes every queued generation, builds one plan
per lane, fences it on the in-flight batches of the other direction that share GPU blocks, and
submits it. The engine resolves each batch's handle on its own thread; ``complete_batch`` runs
on the loop thread (``call_soon_threadsafe``), applies the bookkeeping of the whole lane with
array operations, then resolves the lane's futures.

Errors: a plan that cannot be built (a typed kvmgr error) or an engine that refuses a batch
fails that lane's swaps with ``TransferError`` and rolls their bookkeeping back; any other
exception (a bug) fails them with that very exception and is re-raised after the other lanes
were submitted, so nothing is orphaned and nothing is relabelled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import operator
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvmgr.errors import (
    ClosedError,
    InvalidArgumentError,
    KVMgrError,
    StaleKVTensorError,
    TransferError,
)
from kvmgr.hooks import HookReport, StepHook
from kvmgr.manager.bookkeeping import Bookkeeper
from kvmgr.manager.queue import Batch, Lane, SwapQueue
from kvmgr.reports import DirectionReport
from kvmgr.transfer.engine import BatchResult, TransferEngine
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan

__all__ = ["Flusher"]

#: Completed-batch results kept for the next ``StepReport`` (older ones are dropped, so a
#: caller that never calls ``step()``, e.g. with ``flush="tick"``, does not grow memory).
MAX_COMPLETED = 4096

_NOTHING = DirectionReport()  # frozen: shared by every flush that submits nothing
_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")
_stride = torch.Tensor.stride
_dtype = operator.attrgetter("dtype")


class Flusher:
    """Submits queued lanes and completes batches for one manager."""

    def __init__(
        self,
        books: Bookkeeper,
        queue: SwapQueue,
        engine: TransferEngine,
        tensors: list[torch.Tensor],
    ) -> None:
        self.books = books
        self.queue = queue
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_settled: Callable[[], None] = lambda: None
        #: runs before any lane is submitted (lower tiers stage evicted blocks)
        self.before_submit: Callable[[], None] = lambda: None
        self._completed: collections.deque[BatchResult] = collections.deque(maxlen=MAX_COMPLETED)
        self._prebuilt: dict[int, TransferPlan] = {}  # lane id -> its plan (duplex steps)
        self._tensors = tensors
        self._ptrs = list(map(_data_ptr, tensors))
        self._shapes = list(map(_shape, tensors))
        self._strides = list(map(_stride, tensors))
        self._dtypes = list(map(_dtype, tensors))
        cpu_layout = books.cpu_pool.layout
        self._layouts = {
            Direction.D2H: (books.gpu_layout, cpu_layout),
            Direction.H2D: (cpu_layout, books.gpu_layout),
        }

    @staticmethod
    def check_hook_reports(hooks: Sequence[StepHook], reports: Sequence[object]) -> None:
        """Raises InvalidArgumentError: a hook returned something else than a HookReport."""
        for hook, report in zip(hooks, reports):
            if not isinstance(report, HookReport):
                raise InvalidArgumentError(
                    f"hook {getattr(hook, 'name', hook)!r} returned "
                    f"{type(report).__name__}, expected a HookReport (is it async?)"
                )

    def take_completed(self) -> tuple[BatchResult, ...]:
        """Results of the batches completed since the last call."""
        completed = tuple(self._completed)
        self._completed.clear()
        return completed

    def _moved_tensor(self) -> str | None:
        """Why a KV tensor no longer matches the layout, or ``None``: its data pointer, shape or
        strides or dtype changed since the manager was built (``resize_``, ``set_``,
        ``as_strided_``, ``.data =``, an in-place view op). Exact: 4 C calls per tensor compared
        as four lists."""
        tensors = self._tensors
        if (
            list(map(_data_ptr, tensors)) == self._ptrs
            and list(map(_shape, tensors)) == self._shapes
            and list(map(_stride, tensors)) == self._strides
            and list(map(_dtype, tensors)) == self._dtypes
        ):
            return None
        for i, (tensor, ptr, shape, stride, dtype) in enumerate(
            zip(tensors, self._ptrs, self._shapes, self._strides, self._dtypes)
        ):
            if (
                tensor.data_ptr() != ptr or tensor.shape != shape
                or tensor.stride() != stride or tensor.dtype != dtype
            ):  # fmt: skip
                return (
                    f"KV tensor {i} moved or changed shape after the manager was built "
                    f"(data_ptr {ptr:#x} -> {tensor.data_ptr():#x}, shape {list(shape)} -> "
                    f"{list(tensor.shape)}, strides {stride} -> {tensor.stride()}, dtype "
                    f"{dtype} -> {tensor.dtype}): resize_()/set_()/as_strided_()/.data= on a "
                    "managed KV tensor"
                )
        return None

    # ------------------------------------------------------------------ flush

    def flush(self) -> tuple[DirectionReport, DirectionReport]:
        """Submit every queued lane; returns the (D2H, H2D) reports of this flush."""
        generations = self.queue.take()
        d2h = h2d = _NOTHING
        if not any(map(len, generations)):
            return d2h, h2d
        moved = self._moved_tensor()
        self.before_submit()
        bug: BaseException | None = None
        duplex = getattr(self.engine, "plan_duplex", None)  # engine "auto": paths per step
        for generation in generations:
            lanes = generation.lanes
            if duplex is not None and lanes[Direction.D2H].parts and lanes[Direction.H2D].parts:
                lanes = {d: lanes[d] for d in duplex(*self._counts(lanes))}
            for direction, lane in lanes.items():
                if not lane.parts:
                    continue
                gpu_ids, cpu_ids = lane.arrays()
                if moved is not None:
                    self._fail_lane(lane, gpu_ids, cpu_ids, StaleKVTensorError(moved))
                    continue
                try:
                    report = self._submit(direction, lane, gpu_ids, cpu_ids)
                except KVMgrError as exc:
                    error = (
                        exc
                        if isinstance(exc, TransferError)
                        else TransferError(f"could not submit the {direction.value} batch: {exc}")
                    )
                    self._fail_lane(lane, gpu_ids, cpu_ids, error)
                    continue
                except Exception as exc:  # a bug: fail the swaps with it, raise after the rest
                    self._fail_lane(lane, gpu_ids, cpu_ids, exc)
                    bug = bug or exc
                    continue
                if direction is Direction.D2H:
                    d2h = report if d2h is _NOTHING else d2h + report
                else:
                    h2d = report if h2d is _NOTHING else h2d + report
        self._prebuilt.clear()
        if bug is not None:
            raise bug
        return d2h, h2d

    def _counts(self, lanes: dict[Direction, Lane]) -> tuple[tuple[int, int], ...]:
        """(descriptors, bytes) of each direction's lane, D2H first, from its plan (built here
        and kept for ``_submit``); one descriptor per page if the plan cannot be built (its
        error is raised again, as usual, by ``_submit``)."""
        layout = self.books.gpu_layout
        counts = []
        for direction in (Direction.D2H, Direction.H2D):
            lane = lanes[direction]
            gpu_ids, cpu_ids = lane.arrays()
            try:
                plan = self._plan(direction, gpu_ids, cpu_ids)
            except KVMgrError:
                n = len(gpu_ids)
                counts.append((n * layout.num_tensors, n * layout.block_bytes))
                continue
            self._prebuilt[id(lane)] = plan
            counts.append((plan.num_descriptors, plan.num_bytes))
        return tuple(counts)

    def _plan(self, direction: Direction, gpu_ids: np.ndarray, cpu_ids: np.ndarray) -> TransferPlan:  # fmt: skip
        src, dst = (gpu_ids, cpu_ids) if direction is Direction.D2H else (cpu_ids, gpu_ids)
        src_layout, dst_layout = self._layouts[direction]
        return build_plan(
            direction, src_layout, dst_layout, src, dst, merge=self.books.config.merge
        )

    def _submit(
        self, direction: Direction, lane: Lane, gpu_ids: np.ndarray, cpu_ids: np.ndarray
    ) -> DirectionReport:
        plan = self._prebuilt.pop(id(lane), None) or self._plan(direction, gpu_ids, cpu_ids)
        queue = self.queue
        fences = queue.fences(direction, gpu_ids)
        handle = self.engine.submit(plan, wait_for=[b.handle for b in fences])
        batch = Batch(
            queue.next_seq(),
            lane,
            gpu_ids,
            cpu_ids,
            handle,
            time.perf_counter(),
            tuple(b.seq for b in fences),
        )
        queue.launched(batch)
        self.books.counters.batch_blocks.observe(len(gpu_ids))
        loop = self.loop
        assert loop is not None

        def on_done(_: object) -> None:  # runs on an engine thread (or here, if already done)
            with contextlib.suppress(RuntimeError):  # loop closed: close() settles the batch
                loop.call_soon_threadsafe(self.complete_batch, batch)

        handle.future.add_done_callback(on_done)
        pairs = plan.blocks  # build_plan's own record: its byte count, no second sum
        return DirectionReport(
            swaps=len(lane.parts),
            blocks=plan.num_blocks,
            pages=plan.num_pages,
            descriptors=plan.num_descriptors,
            bytes=plan.num_bytes if pairs is None else pairs.num_bytes,
            batches=1,
        )

    # ------------------------------------------------------------------ completion

    def _fail_lane(
        self, lane: Lane, gpu_ids: np.ndarray, cpu_ids: np.ndarray, error: BaseException
    ) -> None:
        """A lane that was never submitted (or whose copy failed): roll back, fail futures."""
        self.books.complete(lane, gpu_ids, cpu_ids, ok=False)
        _resolve(lane, error)
        self.on_settled()

    def fail_queued(self, error: BaseException) -> None:
        """Fail every queued (not submitted) swap with ``error``; roll their bookkeeping back."""
        for generation in self.queue.take():
            for lane in generation.lanes.values():
                if lane.parts:
                    gpu_ids, cpu_ids = lane.arrays()
                    self._fail_lane(lane, gpu_ids, cpu_ids, error)

    def complete_batch(self, batch: Batch) -> None:
        """Apply a finished batch (on the loop thread); a no-op if already settled."""
        if not self.queue.landed(batch):
            return
        future = batch.handle.future
        if not future.done():
            # closed while the copy may still run: fail the awaits but keep every block fenced
            # (no rollback: the DMA may still read or write them)
            _resolve(batch.lane, ClosedError("manager closed while the copy was in flight"))
            return
        error = future.exception()
        counters = self.books.counters
        if error is None:
            result = future.result()
            self._completed.append(result)
            if result.direction is Direction.D2H:
                counters.bytes_d2h += result.num_bytes
                counters.device_s_d2h += result.device_s or 0.0
            else:
                counters.bytes_h2d += result.num_bytes
                counters.device_s_h2d += result.device_s or 0.0
        counters.completion_s.observe(time.perf_counter() - batch.submitted_s)
        self.books.complete(batch.lane, batch.gpu_ids, batch.cpu_ids, ok=error is None)
        _resolve(batch.lane, error)
        self.on_settled()


def _resolve(lane: Lane, error: BaseException | None) -> None:
    """Resolve the lane's futures (those not cancelled by their awaiters)."""
    if error is None:
        for part in lane.parts:
            try:
                part.future.set_result(part.result)
            except asyncio.InvalidStateError:  # cancelled: its awaiter gave up
                continue
        return
    for part in lane.parts:
        future = part.future
        if not future.done():
            future.set_exception(error)
            future.exception()  # mark retrieved: an unawaited failure is reported by stats
