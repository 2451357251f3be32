"""Transfers: plans, engines, streams and events, completion.

Offers:
    Direction, TransferPlan, build_plan, check_hazards   (plan.py)
    TransferEngine, BatchHandle, BatchResult, EngineStatistics   (engine.py)
    HostEngine   real copies between CPU tensors on a worker thread (host.py)
    ENGINES      engine name -> factory: "host", "cuda", "kernel", "auto"
    make_engine  an engine by name

The CUDA engines (cuda_engine.py: ``CopyStreams`` from streams.py around one issuer from dma.py,
kernel.py or auto.py) are imported only when asked for, so this package imports on machines
without a GPU driver or Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvmgr.errors import ConfigError, GeometryError
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.host import HostEngine
from kvmgr.transfer.pinning import PinOptions
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan, check_hazards

__all__ = [
    "ENGINES",
    "BatchHandle",
    "BatchResult",
    "Direction",
    "EngineStatistics",
    "HostEngine",
    "TransferEngine",
    "TransferPlan",
    "build_plan",
    "check_hazards",
    "make_engine",
]


def _host(device: torch.device, config: Any) -> TransferEngine:
    del config
    if device.type != "cpu":
        raise GeometryError(f"the host engine needs CPU tensors, got {device}")
    return HostEngine()


def _cuda_options(name: str, device: torch.device, config: Any) -> dict[str, Any]:
    if device.type != "cuda":
        raise GeometryError(f"engine {name!r} needs CUDA tensors, got {device}")
    options: dict[str, Any] = {"device": device}
    if config is not None:
        options["allow_pageable"] = config.allow_pageable
        options["pin"] = PinOptions(background=config.pin_host == "background")
        if config.max_descriptors is not None:
            options["max_descriptors"] = config.max_descriptors
    return options


def _cuda(device: torch.device, config: Any) -> TransferEngine:
    from kvmgr.transfer.cuda_engine import CudaBatchEngine

    return CudaBatchEngine(**_cuda_options("cuda", device, config))


def _kernel(device: torch.device, config: Any) -> TransferEngine:
    from kvmgr.transfer.cuda_engine import CopyKernelEngine

    return CopyKernelEngine(**_cuda_options("kernel", device, config))


def _auto(device: torch.device, config: Any) -> TransferEngine:
    if device.type == "cpu":
        return HostEngine()
    from kvmgr.transfer.cuda_engine import AutoEngine

    return AutoEngine(**_cuda_options("auto", device, config))


#: Engine name -> factory ``(device, config) -> TransferEngine`` (``make_engine``'s registry).
ENGINES: dict[str, Callable[[torch.device, Any], TransferEngine]] = {
    "host": _host,
    "cuda": _cuda,
    "kernel": _kernel,
    "auto": _auto,
}


def make_engine(name: str, device: torch.device, config: Any = None) -> TransferEngine:
    """Build the engine called ``name`` for KV tensors on ``device``.

    ``"auto"`` is the host engine for CPU tensors and the per-batch DMA/kernel choice
    (``AutoEngine``) for CUDA tensors.

    Args:
        name: a key of ``ENGINES``: ``"host"``, ``"cuda"``, ``"kernel"`` or ``"auto"``.
        device: device of the GPU-tier KV tensors.
        config: a ``ManagerConfig`` (its ``max_descriptors``, ``allow_pageable`` and
            ``pin_host`` are used).

    Raises:
        ConfigError: unknown name.
        GeometryError: the engine does not suit the device (host engine with CUDA tensors, a
            CUDA engine with CPU tensors).
    """
    factory = ENGINES.get(name)
    if factory is None:
        raise ConfigError(f"unknown engine {name!r}; supported: {', '.join(ENGINES)}")
    if device.type not in ("cpu", "cuda"):
        raise GeometryError(f"expected CPU or CUDA KV tensors, got device {device}")
    return factory(device, config)
