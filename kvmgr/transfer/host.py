"""The host engine: real copies between CPU tensors, for machines without a GPU.

Offers:
    HostEngine      performs each plan with ``memmove`` on one worker thread, in FIFO order

The "GPU" KV tensors are CPU tensors; the bookkeeping, the plans and the completion path are the
same as on a GPU, so the simulator, the tests and CI exercise real data movement anywhere.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import time
from collections.abc import Sequence

import attrs
import torch

from kvmgr.errors import ClosedError, TransferError
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["HostEngine"]


class HostEngine(TransferEngine):
    """Copies with ``ctypes.memmove`` on a single worker thread.

    One thread serves both directions, so batches complete in submission order and every
    ``wait_for`` dependency (always an earlier batch) is already satisfied when a batch starts.
    """

    name = "host"

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvmgr-host-copy"
        )
        self._lock = threading.Lock()
        self._next_batch_id = 0
        self._closed = False
        self._stats = EngineStatistics(path="host")

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
        """
        if self._closed:
            raise ClosedError("host engine is closed")
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
            for src, dst, size in zip(
                plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.sizes.tolist()
            ):
                ctypes.memmove(dst, src, size)
        except Exception as exc:  # pragma: no cover - memmove does not raise on valid plans
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


def _bump(stats: EngineStatistics, **deltas: float) -> EngineStatistics:
    return attrs.evolve(stats, **{k: getattr(stats, k) + v for k, v in deltas.items()})
