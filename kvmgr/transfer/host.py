"""The host engine: real copies between CPU tensors, for machines without a GPU.

Offers:
    HostEngine      performs each plan on one worker thread, in FIFO order

The "GPU" KV tensors are CPU tensors; the bookkeeping, the plans and the completion path are the
same as on a GPU, so the simulator, the tests and CI exercise real data movement anywhere.

How a plan is copied, on the worker thread (never on the caller's, so the event loop keeps
running):

- plans with few descriptors (merged runs: at most ``_RUNS_PER_TENSOR`` per tensor) with one
  ``ctypes.memmove`` per descriptor, which releases the GIL while it copies;
- plans built by ``build_plan`` with many descriptors (scattered blocks) with bulk copies per
  tensor: ``numpy.take`` of 64 source pages at a time into a reused buffer, then a fancy-index
  assignment into the destination pages, over ``uint8 [num_blocks, page_bytes]`` views made from
  the layouts' addresses (numpy releases the GIL while it copies; no Python per page). The plan's ``blocks`` record says
  which pages; it is used only while its byte and descriptor counts still match the descriptors;
- any other plan (hand-made or edited) from its descriptors with ``memmove``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from kvmgr.errors import ClosedError, GeometryError, TransferError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.plan import BlockPairs, Direction, TransferPlan

__all__ = ["HostEngine"]

#: Plans with at most this many descriptors per tensor are copied descriptor by descriptor.
_RUNS_PER_TENSOR = 4
#: Pages gathered per step of the bulk copy: 64 x 4 KiB = 256 KiB stays in cache between the
#: gather and the scatter (on this CPU as fast as one memmove per page, with ~1/30 of the GIL).
_CHUNK_ROWS = 64
#: Nice increment of the copy thread: when both are runnable, the loop's thread gets the CPU.
_WORKER_NICE = 10


class HostEngine(TransferEngine):
    """Copies on a single worker thread (module docstring: memmove or one bulk copy per tensor).

    One thread serves both directions, so batches complete in submission order and every
    ``wait_for`` dependency (always an earlier batch) is already satisfied when a batch starts.
    """

    name = "host"

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvmgr-host-copy", initializer=_lower_priority
        )
        self._lock = threading.Lock()
        self._next_batch_id = 0
        self._closed = False
        self._stats = EngineStatistics(path="host")
        # worker-thread state: page views by (address, stride, page bytes, blocks), gather buffers
        self._views: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._buffers: dict[int, np.ndarray] = {}

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """A plain CPU ``uint8 [num_bytes]`` tensor (no pinning without a GPU).

        Raises:
            TransferError: the memory could not be allocated.
        """
        try:
            return torch.empty(num_bytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise TransferError(f"cannot allocate a CPU tier of {num_bytes} bytes: {exc}") from None

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Queue the plan on the worker thread. See ``TransferEngine.submit``.

        Raises:
            ClosedError: the engine is closed.
            GeometryError: the plan was built over tensors that are not on the CPU (the host
                engine would dereference device addresses).
        """
        if self._closed:
            raise ClosedError("host engine is closed")
        pairs = plan.blocks
        if pairs is not None and {pairs.src.device.type, pairs.dst.device.type} != {"cpu"}:
            raise GeometryError(
                f"the host engine copies between CPU tensors, got a plan from "
                f"{pairs.src.device} to {pairs.dst.device}"
            )
        del wait_for  # FIFO on one thread: earlier batches have already run
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        with self._lock:
            self._stats = _bump(self._stats, batches_submitted=1, in_flight=1)
        future = self._executor.submit(self._run, batch_id, plan)
        return BatchHandle(batch_id, plan.direction, future)

    def _run(self, batch_id: int, plan: TransferPlan) -> BatchResult:
        start = time.perf_counter()
        try:
            pairs = plan.matching_blocks()
            if (
                pairs is not None
                and plan.num_descriptors > _RUNS_PER_TENSOR * pairs.src.num_tensors
            ):
                self._copy_pages(pairs)
            else:
                for src, dst, size in zip(
                    plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.sizes.tolist()
                ):
                    ctypes.memmove(dst, src, size)
        except Exception as exc:  # pragma: no cover - the copies do not raise on valid plans
            with self._lock:
                self._stats = _bump(self._stats, batches_failed=1, in_flight=-1)
            raise TransferError(f"host copy of batch {batch_id} failed: {exc}") from exc
        elapsed = time.perf_counter() - start
        d2h = plan.direction is Direction.D2H
        with self._lock:
            self._stats = _bump(
                self._stats,
                batches_completed=1,
                in_flight=-1,
                **{
                    "bytes_d2h" if d2h else "bytes_h2d": plan.num_bytes,
                    "device_s_d2h" if d2h else "device_s_h2d": elapsed,
                },
            )
        return BatchResult(
            batch_id=batch_id,
            direction=plan.direction,
            num_bytes=plan.num_bytes,
            num_descriptors=plan.num_descriptors,
            device_s=elapsed,
            path="host",
        )

    def _copy_pages(self, pairs: BlockPairs) -> None:
        """Per tensor, gather ``_CHUNK_ROWS`` source pages into a cache-sized buffer, then scatter
        them into the destination pages (worker thread; numpy releases the GIL while copying)."""
        src_ids, dst_ids = pairs.src_block_ids, pairs.dst_block_ids
        n = len(src_ids)
        for t in range(pairs.src.num_tensors):
            src, dst = self._pages(pairs.src, t), self._pages(pairs.dst, t)
            page = src.shape[1]
            buffer = self._buffers.get(page)
            if buffer is None:
                buffer = self._buffers[page] = np.empty((_CHUNK_ROWS, page), dtype=np.uint8)
            for first in range(0, n, _CHUNK_ROWS):
                rows = buffer[: min(_CHUNK_ROWS, n - first)]
                np.take(src, src_ids[first : first + _CHUNK_ROWS], axis=0, out=rows)
                dst[dst_ids[first : first + _CHUNK_ROWS]] = rows

    def _pages(self, layout: KVLayout, t: int) -> np.ndarray:
        """``uint8 [num_blocks, page_bytes]`` view of tensor ``t`` of a layout, from its address."""
        key = (
            int(layout.base_addrs[t]),
            int(layout.block_strides[t]),
            int(layout.page_bytes[t]),
            layout.num_blocks,
        )
        view = self._views.get(key)
        if view is None:
            address, stride, page, blocks = key
            span = (blocks - 1) * stride + page
            memory = (ctypes.c_uint8 * span).from_address(address)
            flat = np.frombuffer(memoryview(memory).cast("B"), dtype=np.uint8)
            view = np.lib.stride_tricks.as_strided(flat, (blocks, page), (stride, 1))
            self._views[key] = view
        return view

    def close(self, timeout_s: float | None = None) -> None:
        """Finish queued batches, then stop the worker thread. Idempotent.

        ``timeout_s`` is accepted for interface parity; host copies are short and always finish.
        """
        del timeout_s
        self._closed = True
        self._executor.shutdown(wait=True)

    def statistics(self) -> EngineStatistics:
        """Totals since creation."""
        with self._lock:
            return self._stats


def _lower_priority() -> None:
    """Give the copy thread a lower CPU priority than the event loop's thread (Linux schedules
    threads as tasks, so this is per thread); a no-op where that is not supported."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WORKER_NICE)


def _bump(stats: EngineStatistics, **deltas: float) -> EngineStatistics:
    return attrs.evolve(stats, **{k: getattr(stats, k) + v for k, v in deltas.items()})
