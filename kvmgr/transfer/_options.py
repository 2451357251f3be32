"""Argument checks and assembly shared by the CUDA engines' constructors (private).

Offers:
    DEFAULT_MAX_DESCRIPTORS     descriptor cap per driver call
    dma_parts                   validate the DMA options, resolve device and driver, build DmaCopy
    kernel_options              validate the copy kernel's options
    check_plan                  the cheap checks ``submit`` makes on every plan
"""

from __future__ import annotations

from typing import Any

import torch

from kvmgr.errors import ConfigError, GeometryError, TransferError
from kvmgr.kernels.copy.row import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_D2H_PROGRAMS,
    DEFAULT_H2D_PROGRAMS,
)
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.pinning import PinOptions
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["DEFAULT_MAX_DESCRIPTORS", "check_plan", "dma_parts", "kernel_options"]

#: Descriptors per driver call. A call costs ~0.6-0.9 us (D2H) or ~1.5-1.8 us (H2D) of host time
#: per 4 KiB descriptor on the H200, so a chunk holds the caller for ~5-15 ms and the device starts
#: on it while the next is issued.
DEFAULT_MAX_DESCRIPTORS = 8192
_COPY_PATHS = ("auto", "batch", "loop")
_BATCH_CALLS = ("ctypes", "lists")
_H2D_PRIORITIES = ("high", "normal")


def dma_parts(
    device: int | str | torch.device | None, options: dict[str, Any]
) -> tuple[torch.device, DmaCopy, CopyDriver, dict[str, Any]]:
    """Validate the DMA options (before touching CUDA), then resolve the device and driver.

    Returns ``(device, DmaCopy, driver, CudaEngine keyword arguments)``.
    """
    copy_path, batch_call, driver, common = _dma_options(options)
    max_descriptors = common["max_descriptors"]
    if not torch.cuda.is_available():
        raise TransferError(
            "the cuda engine needs a CUDA device: torch.cuda.is_available() is False"
        )
    dev = _cuda_device(device)
    try:
        driver = driver or CopyDriver()
    except RuntimeError as exc:
        raise TransferError(f"could not load the CUDA driver: {exc}") from exc
    if copy_path == "batch" and driver.batch_abi is None:
        raise TransferError(
            f"copy_path='batch' needs cuMemcpyBatchAsync (CUDA >= 12.8), driver reports "
            f"{driver.driver_version}"
        )
    path = "loop" if copy_path == "loop" or driver.batch_abi is None else "batch"
    dma = DmaCopy(driver, path, max_descriptors, batch_call)
    return dev, dma, driver, common


def _dma_options(options: dict[str, Any]) -> tuple[str, str, Any, dict[str, Any]]:
    """Pop and check ``dma_parts``'s options (touching no CUDA): ``(copy_path, batch_call,
    driver or None, CudaEngine keyword arguments)``.

    Raises:
        ConfigError: an unknown option or a bad value.
    """
    copy_path = options.pop("copy_path", "auto")
    batch_call = options.pop("batch_call", "ctypes")
    h2d_priority = options.pop("h2d_priority", "high")
    max_descriptors = options.pop("max_descriptors", DEFAULT_MAX_DESCRIPTORS)
    allow_pageable = options.pop("allow_pageable", False)
    pin = options.pop("pin", None)
    driver = options.pop("driver", None)
    if options:
        raise ConfigError(f"unknown engine options {sorted(options)}")
    _check_choice("copy_path", copy_path, _COPY_PATHS)
    _check_choice("batch_call", batch_call, _BATCH_CALLS)
    _check_choice("h2d_priority", h2d_priority, _H2D_PRIORITIES)
    if pin is not None and not isinstance(pin, PinOptions):
        raise ConfigError(f"expected pin to be a PinOptions, got {type(pin).__name__}")
    if not _is_count(max_descriptors):
        raise ConfigError(f"expected max_descriptors >= 1, got {max_descriptors!r}")
    common = {"max_descriptors": max_descriptors, "allow_pageable": allow_pageable,
              "h2d_priority": h2d_priority, "pin": pin}  # fmt: skip
    return copy_path, batch_call, driver, common


def kernel_options(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Pop and validate the kernel's options; returns ``(KernelCopy kwargs, warmup)``."""
    max_programs = options.pop("max_programs", None)
    d2h = options.pop("d2h_programs", None)
    h2d = options.pop("h2d_programs", None)
    chunk_bytes = options.pop("chunk_bytes", DEFAULT_CHUNK_BYTES)
    warmup = bool(options.pop("warmup", True))
    for name, value in (("max_programs", max_programs), ("d2h_programs", d2h),
                        ("h2d_programs", h2d)):  # fmt: skip
        if value is not None and not _is_count(value):
            raise ConfigError(f"expected {name} >= 1, got {value!r}")
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int)
        or chunk_bytes < 16
        or chunk_bytes % 16
    ):
        raise ConfigError(f"expected chunk_bytes a positive multiple of 16, got {chunk_bytes!r}")
    d2h = d2h or max_programs or DEFAULT_D2H_PROGRAMS
    h2d = h2d or max_programs or DEFAULT_H2D_PROGRAMS
    return {"d2h_programs": d2h, "h2d_programs": h2d, "chunk_bytes": chunk_bytes}, warmup


def _is_count(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


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


def check_plan(plan: TransferPlan) -> None:
    if not isinstance(plan, TransferPlan) or not isinstance(plan.direction, Direction):
        raise ValueError(f"expected a TransferPlan with a Direction, got {plan!r}")
    if plan.is_from_blocks:  # built by build_plan from checked ids: nothing to check, nor to build
        return
    if not len(plan.src_addrs) == len(plan.dst_addrs) == len(plan.sizes):
        raise ValueError(
            f"expected equal descriptor arrays, got {len(plan.src_addrs)} sources, "
            f"{len(plan.dst_addrs)} destinations, {len(plan.sizes)} sizes"
        )
    sizes = plan.sizes
    if len(sizes) and sizes.min() < 0:
        raise GeometryError(f"expected descriptor sizes >= 0, got {int(sizes.min())}")
