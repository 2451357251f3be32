"""The SM copy kernels of the transfer engines (``engine="kernel"`` / ``"auto"``).

Modules (dependencies one-way, each only on those listed before it):
    row         ``copy_row``: one row at the widest vector width; program caps, chunk size
    tables      the kernels' tables, built and checked on the host (numpy only)
    pages       the descriptor kernel: one ``(src, dst, bytes)`` row per page or slice
    blocks      the paged kernel: block runs, page addresses computed on the device
    staging     the engines' staging: tables in pooled pinned slots, one upload, one packed
                launch on the copy stream (``CopyStager``, used by ``kvmgr.transfer.kernel``)

Importing this package imports none of them; its public names load on first use (PEP 562), so
``from kvmgr.kernels.copy import copy_pages`` works and ``kvmgr.kernels.copy.tables`` alone stays
free of Triton. docs/copy-kernel.md describes both kernels, the staging and their figures.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DEFAULT_CHUNK_BYTES": "row", "DEFAULT_D2H_PROGRAMS": "row", "DEFAULT_H2D_PROGRAMS": "row",
    "DEFAULT_MAX_PROGRAMS": "row", "KERNEL_AVAILABLE": "row", "vector_widths": "row",
    "build_descriptor_table": "tables", "build_layout_table": "tables",
    "build_run_table": "tables", "max_run_blocks": "tables",
    "copy_pages": "pages", "copy_pages_reference": "pages", "launch_copy_pages": "pages",
    "copy_blocks": "blocks", "copy_blocks_reference": "blocks", "launch_copy_blocks": "blocks",
}  # fmt: skip

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
