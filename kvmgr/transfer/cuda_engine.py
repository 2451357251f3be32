"""The CUDA engines: which issuer each builds around ``CopyStreams`` (``cuda_base.CudaEngine``).

Offers:
    CudaEngine              ``TransferEngine`` = ``CopyStreams`` + an issuer (``issue(plan, stream)``)
    CudaBatchEngine         engine ``"cuda"``: ``DmaCopy`` (``cuMemcpyBatchAsync`` or a loop)
    CopyKernelEngine        engine ``"kernel"``: ``ChoiceCopy(always_kernel)``, one launch per plan
    AutoEngine              engine ``"auto"``: ``ChoiceCopy(cost_model)``, kernel or DMA per plan
    CudaEngineStatistics    ``EngineStatistics`` plus host memory, ABI, chunk and path counts
    DEFAULT_MAX_DESCRIPTORS descriptor cap per driver call

The three engines differ only in the issuer they build (composition: streams, fences, events and
completion live once in ``kvmgr.transfer.streams``, submission and the pinned CPU tier once in
``kvmgr.transfer.cuda_base``, whose names are re-exported here). A compute stream must call
``stream_wait(handle)`` before reading blocks a load fills (rule 4).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvmgr.errors import ConfigError, TransferError
from kvmgr.kernels.copy.row import KERNEL_AVAILABLE
from kvmgr.transfer._options import DEFAULT_MAX_DESCRIPTORS, dma_parts, kernel_options
from kvmgr.transfer.auto import ChoiceCopy, always_kernel, cost_model, cost_model_staged
from kvmgr.transfer.cost_model import Calibration
from kvmgr.transfer.cuda_base import CudaEngine, CudaEngineStatistics, KernelEngineStatistics
from kvmgr.transfer.duplex import duplex_choice
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.plan import Direction, TransferPlan
from kvmgr.transfer.staged import DEFAULT_STAGING_BYTES, StagedCopy, staged_descriptors

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
            ``h2d_priority``, ``copy_path``, ``batch_call``, ``driver``).

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
