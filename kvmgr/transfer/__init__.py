"""Transfers: plans, engines, streams and events, completion.

Offers:
    Direction, TransferPlan, build_plan, check_hazards   (plan.py)
    TransferEngine, BatchHandle, BatchResult, EngineStatistics   (engine.py)
    HostEngine   real copies between CPU tensors on a worker thread (host.py)
    make_engine  an engine by name: "host", "cuda", "kernel", "auto"

The CUDA engines (cuda_engine.py, kernel_engine.py) are imported only when asked for, so this
package imports on machines without a GPU driver or Triton.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmgr.errors import ConfigError, GeometryError
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.host import HostEngine
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan, check_hazards

__all__ = [
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


def make_engine(name: str, device: torch.device, config: Any = None) -> TransferEngine:
    """Build the engine called ``name`` for KV tensors on ``device``.

    ``"auto"`` is the host engine for CPU tensors and the per-batch DMA/kernel choice
    (``AutoEngine``) for CUDA tensors.

    Args:
        name: ``"host"``, ``"cuda"``, ``"kernel"`` or ``"auto"``.
        device: device of the GPU-tier KV tensors.
        config: a ``ManagerConfig`` (its ``max_descriptors`` and ``allow_pageable`` are used).

    Raises:
        ConfigError: unknown name.
        GeometryError: the engine does not suit the device (host engine with CUDA tensors, a
            CUDA engine with CPU tensors).
    """
    engines = ("host", "cuda", "kernel", "auto")
    if name not in engines:
        raise ConfigError(f"unknown engine {name!r}; supported: {', '.join(engines)}")
    if device.type not in ("cpu", "cuda"):
        raise GeometryError(f"expected CPU or CUDA KV tensors, got device {device}")
    on_cpu = device.type == "cpu"
    if (name == "auto" and on_cpu) or name == "host":
        if not on_cpu:
            raise GeometryError(f"the host engine needs CPU tensors, got {device}")
        return HostEngine()
    if on_cpu:
        raise GeometryError(f"engine {name!r} needs CUDA tensors, got {device}")
    kwargs: dict[str, Any] = {"device": device}
    if config is not None:
        kwargs["allow_pageable"] = config.allow_pageable
        if config.max_descriptors is not None:
            kwargs["max_descriptors"] = config.max_descriptors
    if name == "cuda":
        from kvmgr.transfer.cuda_engine import CudaBatchEngine

        return CudaBatchEngine(**kwargs)
    from kvmgr.transfer.kernel_engine import AutoEngine, CopyKernelEngine

    return (CopyKernelEngine if name == "kernel" else AutoEngine)(**kwargs)
