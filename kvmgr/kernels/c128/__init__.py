"""The DeepSeek-V4 c128 KV compressor: state write, windowed compression, host gate, step hook.

Modules (dependencies one-way, each only on those listed before it):
    layout      constants and ``c128_entry_bytes`` (no torch, no Triton)
    gate        ``c128_boundary``, the host gate (numpy only)
    reference   torch references, ``c128_unpack``, ``rope_cos_sin_cache``
    kernel      the Triton kernels
    host        checks and launches (``Layer``)
    api         ``c128_state_write``, ``c128_compress`` (public)
    hook        ``C128CompressorHook``

Importing this package imports none of them; its public names load on first use (PEP 562), so
``from kvmgr.kernels.c128 import c128_compress`` works and ``kvmgr.kernels.c128.gate`` alone stays
free of Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "C128_RATIO": "layout", "C128_ROPE_DIM": "layout", "c128_entry_bytes": "layout",
    "c128_boundary": "gate", "c128_state_write": "api", "c128_compress": "api",
    "c128_compress_ref": "reference", "c128_state_write_ref": "reference",
    "c128_unpack": "reference", "rope_cos_sin_cache": "reference",
    "C128CompressorHook": "hook",
}  # fmt: skip

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
