"""kvmgr: a KV-cache offload manager for custom LLM serving loops.

Offers:
    OffloadManager      the asyncio facade: lookup, swap_out, swap_in, preempt, resume, step
    ManagerConfig       its settings (frozen attrs)
    StepContext, StepHook, HookReport      per-step hooks
    SwapResult, StoreResult, LoadResult, KVEvent, StepReport, DirectionReport,
    ManagerStatistics   what it reports
    Tier                GPU or CPU, in block tables
    errors              KVMgrError and its subclasses, re-exported here

Kernels and their hooks (Triton) live in ``kvmgr.kernels``; the user testing kit in
``kvmgr.testing``. Neither is imported here, so ``import kvmgr`` needs no Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmgr import errors as _errors
from kvmgr.config import ManagerConfig
from kvmgr.errors import *  # noqa: F403  (the error hierarchy: kvmgr.errors.__all__)
from kvmgr.hooks import HookReport, StepContext, StepHook
from kvmgr.pool.block_table import Tier

if TYPE_CHECKING:  # imported lazily below, so ``kvmgr --version`` never imports torch
    from kvmgr.kernels.c128.gate import c128_boundary
    from kvmgr.kernels.c128.hook import C128CompressorHook
    from kvmgr.kernels.mla.api import (
        grouped_mla_insert,
        mla_insert_reference,
        per_layer_mla_insert,
    )
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook
    from kvmgr.manager import OffloadManager
    from kvmgr.reports import (
        DirectionReport,
        KVEvent,
        LoadResult,
        ManagerStatistics,
        StepReport,
        StoreResult,
        SwapResult,
    )
    from kvmgr.transfer.layerwise import LayerwiseLoad, LayerwiseStore

__version__ = "0.1.0"

#: Names re-exported lazily: the manager and its reports (they import torch, which
#: ``kvmgr --version`` must not) and the kernel entry points (``import kvmgr`` needs no Triton).
_LAZY = {
    "OffloadManager": "kvmgr.manager",
    "DirectionReport": "kvmgr.reports",
    "ManagerStatistics": "kvmgr.reports",
    "StepReport": "kvmgr.reports",
    "SwapResult": "kvmgr.reports",
    "StoreResult": "kvmgr.reports",
    "LoadResult": "kvmgr.reports",
    "KVEvent": "kvmgr.reports",
    "LayerwiseLoad": "kvmgr.transfer.layerwise",
    "LayerwiseStore": "kvmgr.transfer.layerwise",
    "GroupedMLAInsertHook": "kvmgr.kernels.mla.hook",
    "grouped_mla_insert": "kvmgr.kernels.mla.api",
    "per_layer_mla_insert": "kvmgr.kernels.mla.api",
    "mla_insert_reference": "kvmgr.kernels.mla.api",
    "C128CompressorHook": "kvmgr.kernels.c128.hook",
    "c128_boundary": "kvmgr.kernels.c128.gate",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmgr' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "triton":
            raise
        raise ImportError(
            f"kvmgr.{name} needs Triton, which is not installed: pip install 'kvmgr[kernels]'",
            name=exc.name,
        ) from exc
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "C128CompressorHook",
    "DirectionReport",
    "GroupedMLAInsertHook",
    "HookReport",
    "KVEvent",
    "LayerwiseLoad",
    "LayerwiseStore",
    "LoadResult",
    "ManagerConfig",
    "ManagerStatistics",
    "OffloadManager",
    "StepContext",
    "StepHook",
    "StepReport",
    "StoreResult",
    "SwapResult",
    "Tier",
    "__version__",
    "c128_boundary",
    "grouped_mla_insert",
    "mla_insert_reference",
    "per_layer_mla_insert",
]
__all__ += _errors.__all__  # the error hierarchy, re-exported
