"""The CUDA engines' shared base: ``CopyStreams`` around one issuer, and the pinned CPU tier.

Offers (re-exported by ``kvmgr.transfer.cuda_engine``, where the three engines that build an
issuer live):
    CudaEngine              ``TransferEngine`` = ``CopyStreams`` + an issuer (``issue(plan, stream)``)
    CudaEngineStatistics    ``EngineStatistics`` plus host memory, ABI, chunk and path counts
    KernelEngineStatistics  the same class, under the name of an earlier release

``submit`` validates the plan, then ``CopyStreams.submit`` fences the copy stream, brackets
``issuer.issue(plan, stream)`` with events and queues the completion. Host memory is page-locked
region by region (``PinnedRegion``), falling back to pageable memory (DMA only) when allowed.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvmgr.errors import ClosedError
from kvmgr.pool.host_pool import HostRegionLayout
from kvmgr.transfer import pinned
from kvmgr.transfer._options import DEFAULT_MAX_DESCRIPTORS, check_plan
from kvmgr.transfer.auto import ChoiceCopy
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.engine import BatchHandle, EngineStatistics, TransferEngine
from kvmgr.transfer.pinning import PinnedRegion, PinOptions, PinStatistics
from kvmgr.transfer.plan import Direction, TransferPlan
from kvmgr.transfer.streams import CopyIssuer, CopyStreams, StreamTotals

__all__ = ["CudaEngine", "CudaEngineStatistics", "KernelEngineStatistics"]


@attrs.frozen(kw_only=True)
class CudaEngineStatistics(StreamTotals, EngineStatistics):
    """``EngineStatistics`` (totals) plus the stream totals and:

    Attributes:
        host_memory: ``"pinned"``, ``"pageable"`` (a registration fell back) or ``"none"``.
        batch_abi: ``cuMemcpyBatchAsync`` ABI in use (``12080``, ``13000``) or ``None``.
        batch_call: ``"ctypes"`` (raw addresses) or ``"lists"`` (cuda-python lists).
        chunks_submitted: driver calls (or loops, or kernel launches) issued.
        loop_fallbacks: chunks copied by the loop although the batch path was chosen.
        kernel_batches / dma_batches: batches copied by the copy kernel / by the driver.
        max_programs: the kernel's D2H and H2D program caps, ``(0, 0)`` for engine ``"cuda"``.
        submit_s: host seconds spent inside ``submit`` (the caller's thread), summed.
        issue_s: the part of ``submit_s`` spent issuing the copies themselves: driver calls, or
            the copy kernel's table staging, upload and launch. The rest is events, stream
            waits and bookkeeping.
        pinning: one ``PinStatistics`` per host region allocated, in allocation order.
    """

    host_memory: str = "none"
    batch_abi: int | None = None
    batch_call: str = ""
    max_programs: tuple[int, int] = (0, 0)
    pinning: tuple[PinStatistics, ...] = ()


#: The kernel engines report the same statistics (kept as a name for callers).
KernelEngineStatistics = CudaEngineStatistics


class CudaEngine(TransferEngine):
    """A CUDA engine: ``CopyStreams`` around ``issuer``, and a pinned CPU tier.

    Args:
        name: the engine's name (``"cuda"``, ``"kernel"``, ``"auto"``).
        device: the CUDA device.
        issuer: ``DmaCopy``, or ``ChoiceCopy`` over a ``KernelCopy`` and a ``DmaCopy``.
        driver: the resolved entry points the issuer uses (reported in ``statistics()``).
        compute_stream: stream the copies are ordered after; the current stream if ``None``.
        max_descriptors: descriptor cap per driver call (the ``TransferEngine`` attribute).
        allow_pageable: if pinning the CPU tier fails, warn and use pageable memory.
        h2d_priority: ``"high"`` or ``"normal"`` priority for the load stream.
        path: what ``statistics().path`` reports.
        pin: how host regions are page-locked (``PinOptions()``: the first GiB before
            ``allocate_host_region`` returns, the rest in the background).
    """

    def __init__(
        self,
        name: str,
        device: torch.device,
        issuer: CopyIssuer,
        driver: CopyDriver,
        *,
        compute_stream: torch.cuda.Stream | None = None,
        max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
        allow_pageable: bool = False,
        h2d_priority: str = "high",
        path: str = "batch",
        pin: PinOptions | None = None,
    ) -> None:
        self._released = True  # nothing to release until the threads start
        self.name = name
        self.max_descriptors = max_descriptors
        self._device = device
        self._issuer = issuer
        self._driver = driver
        self._allow_pageable = allow_pageable
        self._path = path
        self._pin = pin or PinOptions()
        self._regions: list[PinnedRegion] = []
        self._host_memory = "none"  # "pinned" once allocated; "pageable" if one fell back
        self._closed = False
        self._streams = CopyStreams(device, compute_stream, h2d_priority=h2d_priority, name=name)
        self._released = False

    @property
    def device(self) -> torch.device:
        """The CUDA device the engine copies to and from."""
        return self._device

    @property
    def issuer(self) -> CopyIssuer:
        """What issues the copies (``DmaCopy`` or ``ChoiceCopy``)."""
        return self._issuer

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of a direction."""
        return self._streams.stream(direction)

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """One page-locked ``uint8 [num_bytes]`` CPU tensor (registered in pieces of at most
        64 GiB before returning), unregistered at ``close``. If it ended up pageable, the
        kernel engines copy every later batch by DMA.

        Raises:
            ClosedError: the engine is closed.
            ValueError: ``num_bytes < 1``.
            TransferError: registration failed and ``allow_pageable`` is false.
        """
        if num_bytes < 1:
            raise ValueError(f"expected num_bytes >= 1, got {num_bytes}")
        flat = HostRegionLayout((0,), (1,), num_bytes, num_bytes)
        return self._region(flat, attrs.evolve(self._pin, background=False)).tensor

    def allocate_host_region(self, layout: HostRegionLayout) -> PinnedRegion:
        """The CPU tier laid out as ``layout``, page-locked piece by piece (``PinOptions``):
        ``num_blocks_ready`` counts the blocks usable so far; unregistered at ``close``.

        Raises:
            ClosedError: the engine is closed.
            TransferError: the pieces pinned before returning failed and ``allow_pageable``
                is false.
        """
        return self._region(layout, self._pin)

    def _region(self, layout: HostRegionLayout, options: PinOptions) -> PinnedRegion:
        if self._closed:
            raise ClosedError(f"{self.name} engine is closed")
        device = self._device
        region = PinnedRegion(
            layout,
            lambda: pinned.torch_registrar(),  # looked up per call: tests substitute it
            options,
            allow_pageable=self._allow_pageable,
            on_pageable=self._fell_back_to_pageable,
            thread_init=lambda: torch.cuda.set_device(device),
        )
        self._regions.append(region)
        if self._host_memory == "none":
            self._host_memory = "pinned"
        return region

    def _fell_back_to_pageable(self) -> None:
        """A region has pageable blocks (before any is handed out): DMA only from now on."""
        self._host_memory = "pageable"
        if isinstance(self._issuer, ChoiceCopy):
            self._issuer.pageable_host = True

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Enqueue the plan on its direction's copy stream and return at once.

        A refused driver call or launch does not raise here: the handle's future fails with
        ``TransferError`` (``fail_index`` counts descriptors of the whole plan) after the chunks
        already enqueued have finished.

        Raises:
            ClosedError: the engine is closed.
            ValueError: ``plan`` is malformed (``GeometryError`` for a negative size), or a
                ``wait_for`` handle has no event and is not done.
        """
        entered = time.perf_counter()
        if self._closed:
            raise ClosedError(f"{self.name} engine is closed")
        if not (type(plan) is TransferPlan and type(plan.direction) is Direction and plan.is_from_blocks):  # fmt: skip
            check_plan(plan)  # (a plan from build_plan has nothing to check)
        for other in wait_for:
            if other.end_event is None and not other.done():
                raise ValueError(f"batch {other.batch_id} has no CUDA event to wait on")
        return self._streams.submit(plan, self._issuer, wait_for, entered)

    def stream_wait(self, handle: BatchHandle, stream: Any = None) -> None:
        """Make ``stream`` (the compute stream, else the current one) wait for the batch's end
        event on the device; the host does not block (rule 4: call it before reading loaded
        blocks)."""
        self._streams.stream_wait(handle, stream)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for batches in flight, stop the completion threads, unregister host memory.

        Idempotent. On timeout the engine stays closed to new work but keeps its memory
        registered (copies may still touch it); call ``close`` again to finish.

        Raises:
            TransferTimeoutError: batches were still in flight after ``timeout_s`` seconds.
        """
        if self._released:
            return
        self._closed = True
        self._streams.stop()
        self._streams.join(timeout_s)
        for region in self._regions:
            region.close()
        self._released = True

    async def aclose(self) -> None:
        """``close()`` in a worker thread, so the event loop keeps running."""
        import asyncio

        await asyncio.to_thread(self.close)

    def __enter__(self) -> CudaEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> CudaEngineStatistics:
        """Totals since creation (see ``CudaEngineStatistics``)."""
        totals = self._streams.counters.totals()
        kernel = getattr(self._issuer, "kernel", None)
        programs = (0, 0)
        if kernel is not None:
            programs = (kernel.programs[Direction.D2H], kernel.programs[Direction.H2D])
        dma = self._issuer if isinstance(self._issuer, DmaCopy) else self._issuer.dma  # type: ignore[attr-defined]
        return CudaEngineStatistics(
            **totals,
            path=self._path,
            host_memory=self._host_memory,
            batch_abi=self._driver.batch_abi,
            batch_call=dma.batch_call if dma.path == "batch" else "",
            max_programs=programs,
            pinning=tuple(region.statistics() for region in self._regions),
        )

    def __del__(self) -> None:
        if getattr(self, "_released", True):
            return
        warnings.warn(
            f"{type(self).__name__} on {self._device} was not closed", ResourceWarning, stacklevel=2
        )
        self._closed = True
        self._streams.stop()
