"""The CUDA engines: ``CopyStreams`` around one issuer, and the pinned CPU tier.

Offers:
    CudaEngine              ``TransferEngine`` = ``CopyStreams`` + an issuer (``issue(plan, stream)``)
    CudaBatchEngine         engine ``"cuda"``: ``DmaCopy`` (``cuMemcpyBatchAsync`` or a loop)
    CopyKernelEngine        engine ``"kernel"``: ``ChoiceCopy(always_kernel)``, one launch per plan
    AutoEngine              engine ``"auto"``: ``ChoiceCopy(cost_model)``, kernel or DMA per plan
    CudaEngineStatistics    ``EngineStatistics`` plus host memory, ABI, chunk and path counts
    DEFAULT_MAX_DESCRIPTORS descriptor cap per driver call

The three engines differ only in the issuer they build (composition: streams, fences, events and
completion live once in ``kvmgr.transfer.streams``). ``submit`` validates the plan, then
``CopyStreams.submit`` fences the copy stream, brackets ``issuer.issue(plan, stream)`` with
events and queues the completion. A compute stream must call ``stream_wait(handle)`` before
reading blocks a load fills (rule 4).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import ClosedError, ConfigError, TransferError
from kvmgr.kernels.copy.row import KERNEL_AVAILABLE
from kvmgr.pool.host_pool import HostRegionLayout
from kvmgr.transfer import pinned
from kvmgr.transfer._options import (
    DEFAULT_MAX_DESCRIPTORS,
    check_plan,
    dma_parts,
    kernel_options,
)
from kvmgr.transfer.auto import ChoiceCopy, always_kernel, cost_model, cost_model_staged
from kvmgr.transfer.cost_model import Calibration
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.duplex import duplex_choice
from kvmgr.transfer.engine import BatchHandle, EngineStatistics, TransferEngine
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.pinning import PinnedRegion, PinOptions, PinStatistics
from kvmgr.transfer.plan import Direction, TransferPlan
from kvmgr.transfer.staged import DEFAULT_STAGING_BYTES, StagedCopy, staged_descriptors
from kvmgr.transfer.streams import CopyIssuer, CopyStreams, StreamTotals

__all__ = [
    "DEFAULT_MAX_DESCRIPTORS",
    "AutoEngine",
    "CopyKernelEngine",
    "CudaBatchEngine",
    "CudaEngine",
    "CudaEngineStatistics",
    "KernelEngineStatistics",
]

_LOG = logging.getLogger(__name__)
#: program cap of engine "auto"'s staged device-to-device copies (short: they run at HBM speed)
_STAGED_PROGRAMS = 32


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
        check_plan(plan)
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


class CudaBatchEngine(CudaEngine):
    """Engine ``"cuda"``: ``cuMemcpyBatchAsync`` per plan (per chunk above the cap).

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

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        compute_stream: torch.cuda.Stream | None = None,
        **options: Any,
    ) -> None:
        self._released = True
        dev, dma, driver, common = dma_parts(device, options)
        super().__init__("cuda", dev, dma, driver, compute_stream=compute_stream, path=dma.path,
                         **common)  # fmt: skip


class CopyKernelEngine(CudaEngine):
    """Engine ``"kernel"``: each plan in one copy-kernel launch on its direction's copy stream
    (by DMA only if the CPU tier fell back to pageable memory).

    Args:
        device, compute_stream: as for ``CudaBatchEngine``.
        max_programs: program cap of every launch (both directions), or ``None`` for the
            per-direction defaults (D2H 8, H2D 32; docs/copy-kernel.md says what 32 costs a
            concurrent matmul).
        d2h_programs, h2d_programs: per-direction caps (override ``max_programs``).
        chunk_bytes: descriptors above this are sliced so one merged run spreads over programs.
        warmup: compile the kernel now (one 16-byte device copy) rather than on the first batch.
        **options: ``CudaBatchEngine``'s (``max_descriptors``, ``allow_pageable``,
            ``h2d_priority``, ``copy_path``, ``batch_call``, ``driver``) for the DMA fallback.

    Raises:
        ConfigError: an argument is out of range.
        TransferError: no CUDA device or driver, no Triton, or the warm-up copy failed.
    """

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        compute_stream: torch.cuda.Stream | None = None,
        **options: Any,
    ) -> None:
        self._released = True
        kernel_kwargs, warmup = kernel_options(options)
        if not KERNEL_AVAILABLE:
            raise TransferError("engine 'kernel' needs Triton: pip install 'kvmgr[kernels]'")
        dev, dma, driver, common = dma_parts(device, options)
        kernel = KernelCopy(dev, driver, **kernel_kwargs)
        super().__init__("kernel", dev, ChoiceCopy(dma, kernel, always_kernel), driver,
                         compute_stream=compute_stream, path="kernel", **common)  # fmt: skip
        if warmup:
            try:
                _warmup(self, kernel)
            except Exception as exc:
                self.close()
                raise TransferError(f"the copy kernel failed its warm-up copy: {exc}") from exc


class AutoEngine(CudaEngine):
    """Engine ``"auto"``: per plan the copy kernel or the DMA batch, whichever the cost model
    (copy time plus the compute it slows, ``kvmgr.transfer.cost_model``) says is cheaper.

    Without Triton, or if the kernel fails its warm-up copy (logged), every plan goes to DMA.

    Args:
        calibration: cost-model constants; ``Calibration()`` (H200 figures) if ``None``.
        staging_bytes: GPU bytes of each staging buffer of the staged path (one per direction
            and page geometry, allocated on its first staged plan; ``kvmgr.transfer.staged``);
            0: no staged path.
        staged_programs: program cap of the staged path's device-to-device copies.
        Other arguments as for ``CopyKernelEngine``.

    Raises:
        ConfigError: an argument is out of range.
        TransferError: no CUDA device or driver.
    """

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        compute_stream: torch.cuda.Stream | None = None,
        *,
        calibration: Calibration | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staged_programs: int = _STAGED_PROGRAMS,
        **options: Any,
    ) -> None:
        self._released = True
        if calibration is not None and not isinstance(calibration, Calibration):
            raise ConfigError(f"expected a Calibration, got {type(calibration).__name__}")
        for name, value, least in (("staging_bytes", staging_bytes, 0),
                                   ("staged_programs", staged_programs, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"expected {name} an int >= {least}, got {value!r}")
        self.calibration = calibration or Calibration()
        kernel_kwargs, warmup = kernel_options(options)
        dev, dma, driver, common = dma_parts(device, options)
        kernel = KernelCopy(dev, driver, **kernel_kwargs) if KERNEL_AVAILABLE else None
        staged = None
        if kernel is not None and staging_bytes:
            move = KernelCopy(dev, driver, d2h_programs=staged_programs, h2d_programs=staged_programs)  # fmt: skip
            staged = StagedCopy(dev, move, dma, staging_bytes=staging_bytes)
        choice = ChoiceCopy(dma, kernel, cost_model(self.calibration), staged,
                            cost_model_staged(self.calibration))  # fmt: skip
        super().__init__("auto", dev, choice, driver, compute_stream=compute_stream,
                         path="auto", **common)  # fmt: skip
        if kernel is not None and warmup:
            try:
                _warmup(self, kernel)
            except Exception as exc:
                _LOG.warning("copy kernel unusable (%s); engine 'auto' copies by DMA", exc)
                choice.kernel = choice.staged = None

    def plan_duplex(
        self, d2h: tuple[int, int], h2d: tuple[int, int],
        staged: tuple[int | None, int | None] = (None, None),
    ) -> tuple[Direction, ...]:  # fmt: skip
        """A step is about to submit ``d2h = (descriptors, bytes)`` out and ``h2d`` in (``staged``:
        their staged descriptors, ``None`` where not stageable): choose each direction's path
        knowing the other (``kvmgr.transfer.duplex``) for the next plan of each direction (if it
        has those counts), and return the order to submit them in."""
        issuer = self._issuer
        assert isinstance(issuer, ChoiceCopy)
        if issuer.staged is None:
            staged = (None, None)
        choice = duplex_choice(d2h, h2d, self.calibration, staged=staged)
        issuer.duplex = {
            Direction.D2H: (choice.path(Direction.D2H), *d2h),
            Direction.H2D: (choice.path(Direction.H2D), *h2d),
        }
        second = Direction.H2D if choice.first is Direction.D2H else Direction.D2H
        return choice.first, second

    def plan_duplex_plans(self, d2h: TransferPlan, h2d: TransferPlan) -> tuple[Direction, ...]:
        """``plan_duplex`` for the two plans themselves (their staged descriptors counted:
        O(blocks) numpy each)."""
        staged = (staged_descriptors(d2h), staged_descriptors(h2d))
        return self.plan_duplex((d2h.num_descriptors, d2h.num_bytes),
                                (h2d.num_descriptors, h2d.num_bytes), staged)  # fmt: skip


def _warmup(engine: CudaEngine, kernel: KernelCopy) -> None:
    """Compile the kernel and check one 16-byte device copy through the issuer."""
    stream = engine.stream(Direction.D2H)
    with torch.cuda.device(engine.device):
        src = torch.arange(16, dtype=torch.uint8, device=engine.device)
        dst = torch.zeros(16, dtype=torch.uint8, device=engine.device)
        torch.cuda.current_stream(engine.device).synchronize()
        row = np.array([src.data_ptr(), dst.data_ptr(), 16], dtype=np.int64)
        plan = TransferPlan(Direction.D2H, row[0:1], row[1:2], row[2:3])
        issued = kernel.issue(plan, stream)
        stream.synchronize()
        if issued.release is not None:
            issued.release()
    if issued.error is not None:
        raise issued.error
    if not torch.equal(src, dst):
        raise TransferError("the warm-up copy returned wrong bytes")
