"""The CUDA engine: one batched driver copy per plan, on a dedicated stream, fenced with events.

Offers:
    CudaBatchEngine         ``TransferEngine`` over ``cuMemcpyBatchAsync`` (or a per-copy loop)
    CudaEngineStatistics    ``EngineStatistics`` plus host memory, ABI and fallback counts
    DEFAULT_MAX_DESCRIPTORS descriptor cap per driver call

Ordering (docs/transfer.md): each direction has its own non-default copy stream (H2D at
higher priority). Before a batch, its copy stream waits on an event recorded on the compute stream
(rules 3, 4) and on the end events of ``wait_for`` batches; start and end events bracket the
copies. Batches of one direction therefore run and complete in FIFO order. A compute stream must
call ``stream_wait(handle)`` before reading blocks a load fills (rule 4).

Completion: one worker thread per direction synchronizes end events in submission order (blocking
sync events, no polling), releases the pointer arrays (rule 7) and resolves the futures.

Subclasses change only the work between a batch's events: ``_route`` names the path a plan takes,
``_enqueue`` issues it on the copy stream (``kernel_engine.py`` adds the copy kernel).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import ClosedError, ConfigError, TransferError, TransferTimeoutError
from kvmgr.transfer._driver import CopyDriver, access_order
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.pinned import PinnedHostBuffer
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["DEFAULT_MAX_DESCRIPTORS", "CudaBatchEngine", "CudaEngineStatistics"]

#: Descriptors per driver call. A call costs ~0.6-0.9 us (D2H) or ~1.5-1.8 us (H2D) of host time
#: per 4 KiB descriptor on the H200, so a chunk holds the caller for ~5-15 ms and the device starts
#: on it while the next is issued.
DEFAULT_MAX_DESCRIPTORS = 8192
_COPY_PATHS = ("auto", "batch", "loop")
_BATCH_CALLS = ("ctypes", "lists")
_PRIORITIES = {"high": -1, "normal": 0}  # lower is higher; torch clamps to the device's range


@attrs.frozen(kw_only=True)
class CudaEngineStatistics(EngineStatistics):
    """``EngineStatistics`` (totals) plus:

    Attributes:
        host_memory: ``"pinned"``, ``"pageable"`` (a registration fell back) or ``"none"``.
        batch_abi: ``cuMemcpyBatchAsync`` ABI in use (``12080``, ``13000``) or ``None``.
        batch_call: ``"ctypes"`` (numpy buffers) or ``"lists"`` (cuda-python lists).
        chunks_submitted: driver calls (or loops) issued, after splitting at the cap.
        loop_fallbacks: chunks copied by the loop although the batch path was chosen.
        submit_s: host seconds spent inside ``submit`` (the caller's thread), summed.
        issue_s: the part of ``submit_s`` spent issuing the copies themselves: driver calls, or
            the copy kernel's table staging, upload and launch. The rest is events, stream
            waits and bookkeeping.
    """

    host_memory: str = "none"
    batch_abi: int | None = None
    batch_call: str = ""
    chunks_submitted: int = 0
    loop_fallbacks: int = 0
    submit_s: float = 0.0
    issue_s: float = 0.0


@attrs.define
class _Counters:
    batches_submitted: int = 0
    batches_completed: int = 0
    batches_failed: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    device_s_d2h: float = 0.0
    device_s_h2d: float = 0.0
    in_flight: int = 0
    chunks_submitted: int = 0
    loop_fallbacks: int = 0
    submit_s: float = 0.0
    issue_s: float = 0.0


@attrs.define(eq=False)
class _InFlight:
    handle: BatchHandle
    start: Any  # torch.cuda.Event
    num_bytes: int
    num_descriptors: int
    path: str
    keep_alive: tuple[Any, ...]  # the plan and its arrays or table, until the end event (rule 7)
    error: TransferError | None


class CudaBatchEngine(TransferEngine):
    """Copies plans with ``cuMemcpyBatchAsync`` on two dedicated CUDA streams.

    Args:
        device: CUDA device (index, ``"cuda:N"`` or ``torch.device``); the current one if ``None``.
        compute_stream: stream the copies are ordered after (and ``stream_wait`` targets by
            default); the current stream at each submit if ``None``.
        max_descriptors: descriptors per driver call; larger plans are split.
        copy_path: ``"batch"`` (require ``cuMemcpyBatchAsync``), ``"loop"`` (``cuMemcpyAsync`` per
            descriptor) or ``"auto"`` (batch when the driver has it).
        batch_call: ``"ctypes"`` (default, faster) or ``"lists"`` (cuda-python binding).
        allow_pageable: if pinning the CPU tier fails, warn and use pageable memory.
        h2d_priority: ``"high"`` or ``"normal"`` priority for the load stream.
        driver: resolved entry points; built with cuda-python if ``None``.

    Raises:
        ConfigError: an argument is out of range.
        TransferError: no CUDA device or driver, or ``copy_path="batch"`` without the entry point.
    """

    name = "cuda"

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        compute_stream: torch.cuda.Stream | None = None,
        *,
        max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
        copy_path: str = "auto",
        batch_call: str = "ctypes",
        allow_pageable: bool = False,
        h2d_priority: str = "high",
        driver: CopyDriver | None = None,
    ) -> None:
        self._released = True  # nothing to release until the threads start
        _check_choice("copy_path", copy_path, _COPY_PATHS)
        _check_choice("batch_call", batch_call, _BATCH_CALLS)
        _check_choice("h2d_priority", h2d_priority, tuple(_PRIORITIES))
        if (
            isinstance(max_descriptors, bool)
            or not isinstance(max_descriptors, int)
            or max_descriptors < 1
        ):
            raise ConfigError(f"expected max_descriptors >= 1, got {max_descriptors!r}")
        if not torch.cuda.is_available():
            raise TransferError(
                "the cuda engine needs a CUDA device: torch.cuda.is_available() is False"
            )
        self._device = _cuda_device(device)
        try:
            self._driver = driver or CopyDriver()
        except RuntimeError as exc:
            raise TransferError(f"could not load the CUDA driver: {exc}") from exc
        if copy_path == "batch" and self._driver.batch_abi is None:
            raise TransferError(
                f"copy_path='batch' needs cuMemcpyBatchAsync (CUDA >= 12.8), driver reports "
                f"{self._driver.driver_version}"
            )
        self._path = "loop" if copy_path == "loop" or self._driver.batch_abi is None else "batch"
        self._batch_call = batch_call
        self.max_descriptors = max_descriptors
        self._allow_pageable = allow_pageable
        self._compute_stream = compute_stream
        self._orders = {d: access_order(d) for d in Direction}
        self._streams = {
            Direction.D2H: torch.cuda.Stream(self._device, priority=_PRIORITIES["normal"]),
            Direction.H2D: torch.cuda.Stream(self._device, priority=_PRIORITIES[h2d_priority]),
        }
        self._fences = {d: torch.cuda.Event() for d in Direction}  # recorded, then waited at once
        self._host_buffers: list[PinnedHostBuffer] = []
        self._host_memory = "none"  # "pinned" once allocated; "pageable" if one fell back
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._next_batch_id = 0
        self._closed = False
        self._queues: dict[Direction, queue.SimpleQueue[_InFlight | None]] = {
            d: queue.SimpleQueue() for d in Direction
        }
        self._threads = [
            threading.Thread(
                target=_complete_in_order,
                args=(self._queues[d], self._counters, self._lock),
                name=f"kvmgr-cuda-{d.value}-done",
                daemon=True,
            )
            for d in Direction
        ]
        for thread in self._threads:
            thread.start()
        self._released = False

    @property
    def device(self) -> torch.device:
        """The CUDA device the engine copies to and from."""
        return self._device

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of a direction."""
        return self._streams[direction]

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """One page-locked ``uint8 [num_bytes]`` CPU tensor, unregistered at ``close``.

        Raises:
            ClosedError: the engine is closed.
            ValueError: ``num_bytes < 1``.
            TransferError: registration failed and ``allow_pageable`` is false.
        """
        if self._closed:
            raise ClosedError("cuda engine is closed")
        buffer = PinnedHostBuffer(num_bytes, allow_pageable=self._allow_pageable)
        self._host_buffers.append(buffer)
        if not buffer.is_registered:
            self._host_memory = "pageable"
        elif self._host_memory == "none":
            self._host_memory = "pinned"
        return buffer.tensor

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Enqueue the plan on its direction's copy stream and return at once.

        A refused driver call does not raise here: the handle's future fails with
        ``TransferError`` (``fail_index`` counts descriptors of the whole plan) after the chunks
        already enqueued have finished.

        Raises:
            ClosedError: the engine is closed.
            ValueError: ``plan`` is malformed, or a ``wait_for`` handle has no event and is not done.
        """
        entered = time.perf_counter()
        if self._closed:
            raise ClosedError("cuda engine is closed")
        _check_plan(plan)
        for other in wait_for:
            if other.end_event is None and not other.done():
                raise ValueError(f"batch {other.batch_id} has no CUDA event to wait on")
        num_bytes = plan.num_bytes
        route = self._route(plan, num_bytes)
        direction = plan.direction
        stream = self._streams[direction]
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.device(self._device):
            compute = self._compute_stream or torch.cuda.current_stream(self._device)
            self._fences[direction].record(compute)
            stream.wait_event(self._fences[direction])
            for other in wait_for:
                if other.end_event is not None:
                    stream.wait_event(other.end_event)
            start.record(stream)
            issued = time.perf_counter()
            error, keep, num_chunks, num_fallbacks = self._enqueue(batch_id, plan, stream, route)
            issue_s = time.perf_counter() - issued
            end.record(stream)
        handle = BatchHandle(batch_id, direction, concurrent.futures.Future(), end_event=end)
        path = "loop" if num_fallbacks else route
        item = _InFlight(handle, start, num_bytes, plan.num_descriptors, path, (plan, keep), error)
        with self._lock:  # counted before the completion thread can see the batch
            counters = self._counters
            counters.batches_submitted += 1
            counters.in_flight += 1
            counters.chunks_submitted += num_chunks
            counters.loop_fallbacks += num_fallbacks
            counters.issue_s += issue_s
            counters.submit_s += time.perf_counter() - entered
        self._queues[direction].put(item)
        return handle

    def _route(self, plan: TransferPlan, num_bytes: int) -> str:
        """The path ``plan`` (of ``num_bytes``) takes: ``"batch"`` or ``"loop"`` here; called
        once per submit, before any CUDA work."""
        del plan, num_bytes
        return self._path

    def _enqueue(
        self, batch_id: int, plan: TransferPlan, stream: torch.cuda.Stream, route: str
    ) -> tuple[TransferError | None, list[Any], int, int]:
        """Issue the copies on ``stream`` (between the batch's events) along ``route``.

        Returns:
            ``(error, keep_alive, num_chunks, num_fallbacks)``: the refusal to report through the
            future (or ``None``), what must live until the end event, chunks issued, and chunks
            the driver copied with the loop instead of the batch.
        """
        arrays: list[Any] = []
        offset = num_chunks = num_fallbacks = 0
        for chunk in plan.split(self.max_descriptors):
            dsts, srcs, sizes = (
                np.ascontiguousarray(a, dtype=np.int64)
                for a in (chunk.dst_addrs, chunk.src_addrs, chunk.sizes)
            )
            arrays += (dsts, srcs, sizes)
            try:
                used = self._driver.copy(
                    route,
                    dsts,
                    srcs,
                    sizes,
                    stream.cuda_stream,
                    self._orders[plan.direction],
                    call=self._batch_call,
                )
            except TransferError as exc:
                index = None if exc.fail_index is None else offset + exc.fail_index
                failure = TransferError(f"batch {batch_id}: {exc}", fail_index=index)
                return failure, arrays, num_chunks, num_fallbacks
            num_chunks += 1
            num_fallbacks += used != route
            offset += len(sizes)
        return None, arrays, num_chunks, num_fallbacks

    def stream_wait(self, handle: BatchHandle, stream: Any = None) -> None:
        """Make ``stream`` (the compute stream, else the current one) wait for the batch's end
        event on the device; the host does not block (rule 4: call it before reading loaded
        blocks)."""
        if handle.end_event is None:
            return
        if stream is None:
            stream = self._compute_stream or torch.cuda.current_stream(self._device)
        stream.wait_event(handle.end_event)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for batches in flight, stop the completion threads, unregister host memory.

        Idempotent. On timeout the engine stays closed to new work but keeps its memory
        registered (copies may still touch it); call ``close`` again to finish.

        Raises:
            TransferTimeoutError: batches were still in flight after ``timeout_s`` seconds.
        """
        if self._released:
            return
        if not self._closed:
            self._closed = True
            for q in self._queues.values():
                q.put(None)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            raise TransferTimeoutError(
                f"{self.statistics().in_flight} batches still in flight after {timeout_s} s"
            )
        for buffer in self._host_buffers:
            buffer.close()
        self._released = True

    async def aclose(self) -> None:
        """``close()`` in a worker thread, so the event loop keeps running."""
        import asyncio

        await asyncio.to_thread(self.close)

    def __enter__(self) -> CudaBatchEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> CudaEngineStatistics:
        """Totals since creation (see ``CudaEngineStatistics``)."""
        with self._lock:
            counters = attrs.asdict(self._counters)
        return CudaEngineStatistics(
            **counters,
            path=self._path,
            host_memory=self._host_memory,
            batch_abi=self._driver.batch_abi,
            batch_call=self._batch_call if self._path == "batch" else "",
        )

    def __del__(self) -> None:
        if getattr(self, "_released", True):
            return
        warnings.warn(
            f"CudaBatchEngine on {self._device} was not closed", ResourceWarning, stacklevel=2
        )
        if not self._closed:
            self._closed = True
            for q in self._queues.values():
                q.put(None)


def _complete_in_order(
    inbox: queue.SimpleQueue[_InFlight | None], counters: _Counters, lock: threading.Lock
) -> None:
    """Completion thread of one direction: wait for each end event in FIFO order."""
    while (item := inbox.get()) is not None:
        handle, error, device_s = item.handle, item.error, 0.0
        try:
            handle.end_event.synchronize()  # blocking-sync event: the thread sleeps, GIL released
            if error is None:
                device_s = item.start.elapsed_time(handle.end_event) / 1e3
        except Exception as exc:  # an asynchronous CUDA error surfaced at the event
            error = error or TransferError(f"batch {handle.batch_id} failed on the device: {exc}")
        item.keep_alive = ()  # the copies have ended: the pointer arrays may go (rule 7)
        with lock:
            counters.in_flight -= 1
            if error is not None:
                counters.batches_failed += 1
            elif handle.direction is Direction.D2H:
                counters.batches_completed += 1
                counters.bytes_d2h += item.num_bytes
                counters.device_s_d2h += device_s
            else:
                counters.batches_completed += 1
                counters.bytes_h2d += item.num_bytes
                counters.device_s_h2d += device_s
        # A cancelled future raises InvalidStateError: nobody is left to tell.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if error is not None:
                handle.future.set_exception(error)
            else:
                handle.future.set_result(
                    BatchResult(
                        batch_id=handle.batch_id,
                        direction=handle.direction,
                        num_bytes=item.num_bytes,
                        num_descriptors=item.num_descriptors,
                        device_s=device_s,
                        path=item.path,
                    )
                )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"expected {name} in {list(choices)}, got {value!r}")


def _cuda_device(device: int | str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ConfigError(f"expected a CUDA device, got {device!r}")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _check_plan(plan: TransferPlan) -> None:
    if not isinstance(plan, TransferPlan) or not isinstance(plan.direction, Direction):
        raise ValueError(f"expected a TransferPlan with a Direction, got {plan!r}")
    if not len(plan.src_addrs) == len(plan.dst_addrs) == len(plan.sizes):
        raise ValueError(
            f"expected equal descriptor arrays, got {len(plan.src_addrs)} sources, "
            f"{len(plan.dst_addrs)} destinations, {len(plan.sizes)} sizes"
        )
