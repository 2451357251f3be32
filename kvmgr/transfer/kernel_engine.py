"""Copy-kernel engines: a whole plan in one Triton launch, and a per-batch DMA/kernel choice.

Offers:
    CopyKernelEngine        ``TransferEngine`` "kernel": one SM copy-kernel launch per plan
    AutoEngine              ``TransferEngine`` "auto": DMA batch or kernel per plan, by cost model
    KernelEngineStatistics  ``CudaEngineStatistics`` plus kernel/DMA batch counts
    Calibration, choose_path    the cost model, re-exported from ``kvmgr.transfer.cost_model``

Both engines subclass ``CudaBatchEngine`` and keep its ordering and completion machinery
(docs/transfer.md): per direction a copy stream that first waits on the compute stream
and on ``wait_for`` batches, start/end events around the work, one completion thread per
direction resolving futures in FIFO order off the event loop. Only the work between the events
differs: instead of ``cuMemcpyBatchAsync`` the plan's descriptor table is staged in pinned memory,
copied to the device on the copy stream and consumed by one ``kvmgr.kernels.copy_pages`` launch.
The table stays referenced until the end event has fired (rule 7).

The kernel dereferences host addresses directly, so every host page in a plan must be pinned or
registered (``allocate_host`` provides that). If the CPU tier fell back to pageable memory
(``allow_pageable=True``), both engines copy with DMA and report it in ``statistics()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import ConfigError, GeometryError, TransferError
from kvmgr.kernels.copy_pages import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_PROGRAMS,
    KERNEL_AVAILABLE,
    copy_pages,
)
from kvmgr.transfer.cost_model import Calibration, choose_path
from kvmgr.transfer.cuda_engine import CudaBatchEngine, CudaEngineStatistics
from kvmgr.transfer.engine import BatchHandle
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = [
    "AutoEngine",
    "Calibration",
    "CopyKernelEngine",
    "KernelEngineStatistics",
    "choose_path",
]

_LOG = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class KernelEngineStatistics(CudaEngineStatistics):
    """``CudaEngineStatistics`` (totals) plus:

    Attributes:
        kernel_batches: batches copied by the copy kernel.
        dma_batches: batches copied by the driver (``auto``'s choice, or pageable host memory).
        max_programs: the kernel's program cap.
    """

    kernel_batches: int = 0
    dma_batches: int = 0
    max_programs: int = 0


class CopyKernelEngine(CudaBatchEngine):
    """Copies each plan with one copy-kernel launch on its direction's copy stream.

    Args:
        device, compute_stream: as for ``CudaBatchEngine``.
        max_programs: program cap of each launch (``kvmgr.kernels.copy_pages``; default 32).
        chunk_bytes: descriptors above this are sliced so one merged run spreads over programs.
        warmup: compile the kernel now (one 16-byte device copy) rather than on the first batch.
        **dma_options: passed to ``CudaBatchEngine`` (``max_descriptors``, ``allow_pageable``,
            ``h2d_priority``, ``copy_path``, ``batch_call``, ``driver``); they shape the DMA
            path that pageable host memory (and ``AutoEngine``) falls back to.

    Raises:
        ConfigError: an argument is out of range.
        TransferError: no CUDA device or driver, no Triton, or the warm-up copy failed.
    """

    name = "kernel"
    #: Whether a missing or failing kernel is an error (else: warn and copy everything by DMA).
    _requires_kernel = True

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        compute_stream: torch.cuda.Stream | None = None,
        *,
        max_programs: int = DEFAULT_MAX_PROGRAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        warmup: bool = True,
        **dma_options: Any,
    ) -> None:
        if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
            raise ConfigError(f"expected max_programs >= 1, got {max_programs!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 16 or chunk_bytes % 16:
            raise ConfigError(
                f"expected chunk_bytes a positive multiple of 16, got {chunk_bytes!r}"
            )
        if self._requires_kernel and not KERNEL_AVAILABLE:
            raise TransferError("engine 'kernel' needs Triton: pip install 'kvmgr[kernels]'")
        super().__init__(device, compute_stream, **dma_options)
        self._max_programs = max_programs
        self._chunk_bytes = chunk_bytes
        self._kernel_ok = KERNEL_AVAILABLE
        self._pageable_host = False
        self._path_counts = {"kernel": 0, "dma": 0}
        self._count_lock = threading.Lock()
        if warmup and self._kernel_ok:
            try:
                self._warmup()
            except Exception as exc:
                if self._requires_kernel:
                    self.close()
                    raise TransferError(f"the copy kernel failed its warm-up copy: {exc}") from exc
                _LOG.warning("copy kernel unusable (%s); engine %r copies by DMA", exc, self.name)
                self._kernel_ok = False

    def _warmup(self) -> None:
        stream = self.stream(Direction.D2H)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            src = torch.arange(16, dtype=torch.uint8, device=self.device)
            dst = torch.zeros(16, dtype=torch.uint8, device=self.device)
            copy_pages([src.data_ptr()], [dst.data_ptr()], [16], device=self.device)
            stream.synchronize()
        if not torch.equal(src, dst):
            raise TransferError("the warm-up copy returned wrong bytes")

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """Pinned ``uint8 [num_bytes]`` CPU tensor (see ``CudaBatchEngine.allocate_host``); if it
        ended up pageable, every later batch is copied by DMA."""
        tensor = super().allocate_host(num_bytes)
        if super().statistics().host_memory == "pageable":  # a registration fell back
            self._pageable_host = True
        return tensor

    def _use_kernel(self, plan: TransferPlan, num_bytes: int) -> bool:
        """Whether this plan goes to the copy kernel (pure given the engine's state)."""
        del num_bytes
        return self._kernel_ok and not self._pageable_host and plan.num_descriptors > 0

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Enqueue the plan (kernel or DMA, see ``_use_kernel``) and return at once.

        Raises:
            ClosedError: the engine is closed.
            ValueError: malformed plan (``GeometryError`` for negative sizes).
        """
        if isinstance(plan, TransferPlan) and plan.num_descriptors:
            smallest = int(np.min(plan.sizes))
            if smallest < 0:
                raise GeometryError(f"expected descriptor sizes >= 0, got {smallest}")
        return super().submit(plan, wait_for=wait_for)

    def _route(self, plan: TransferPlan, num_bytes: int) -> str:
        # Called once per submit by CudaBatchEngine.submit, after validation.
        route = "kernel" if self._use_kernel(plan, num_bytes) else super()._route(plan, num_bytes)
        with self._count_lock:
            self._path_counts["kernel" if route == "kernel" else "dma"] += 1
        return route

    def _enqueue(
        self, batch_id: int, plan: TransferPlan, stream: torch.cuda.Stream, route: str
    ) -> tuple[TransferError | None, list[Any], int, int]:
        # Called by CudaBatchEngine.submit between the start and end events, on `stream`.
        if route != "kernel":
            return super()._enqueue(batch_id, plan, stream, route)
        try:
            with torch.cuda.stream(stream):
                table = copy_pages(
                    plan.src_addrs,
                    plan.dst_addrs,
                    plan.sizes,
                    device=self.device,
                    max_programs=self._max_programs,
                    chunk_bytes=self._chunk_bytes,
                )
        except Exception as exc:  # a launch error: the future fails, the stream stays ordered
            return TransferError(f"batch {batch_id}: copy kernel launch failed: {exc}"), [], 0, 0
        return None, [table], 1, 0  # the device table lives until the end event (rule 7)

    def statistics(self) -> KernelEngineStatistics:
        """Totals since creation (see ``KernelEngineStatistics``)."""
        base = super().statistics()
        with self._count_lock:
            counts = dict(self._path_counts)
        return KernelEngineStatistics(
            **{**attrs.asdict(base, recurse=False), "path": self.name},
            kernel_batches=counts["kernel"],
            dma_batches=counts["dma"],
            max_programs=self._max_programs,
        )


class AutoEngine(CopyKernelEngine):
    """Per plan, the DMA batch or the copy kernel, whichever ``choose_path`` models faster.

    Without Triton, or if the kernel fails its warm-up copy (logged), every plan goes to DMA.

    Args:
        calibration: cost-model constants; ``Calibration()`` (H200 figures) if ``None``.
        Other arguments as for ``CopyKernelEngine``.

    Raises:
        ConfigError: an argument is out of range.
        TransferError: no CUDA device or driver.
    """

    name = "auto"
    _requires_kernel = False

    def __init__(self, *args: Any, calibration: Calibration | None = None, **kwargs: Any) -> None:
        if calibration is not None and not isinstance(calibration, Calibration):
            raise ConfigError(f"expected a Calibration, got {type(calibration).__name__}")
        self._calibration = calibration or Calibration()
        super().__init__(*args, **kwargs)

    @property
    def calibration(self) -> Calibration:
        """The cost model in use."""
        return self._calibration

    def _use_kernel(self, plan: TransferPlan, num_bytes: int) -> bool:
        if not super()._use_kernel(plan, num_bytes):
            return False
        choice = choose_path(plan.num_descriptors, num_bytes, plan.direction, self._calibration)
        return choice == "kernel"


def bench_variants() -> dict[str, Any]:
    """``kvmgr bench swap``'s hook: the ``"kernel"`` and ``"auto"`` columns (see
    ``kvmgr.bench.swap_kernel.variants``)."""
    from kvmgr.bench.swap_kernel import variants

    return variants()
