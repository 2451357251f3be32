"""A step signature's guard: torch's C++ tensor check of one step and, on a packed launch, the
C writer of that launch's cells (private to :mod:`kvmgr.kernels.mla`).

Offers (to :mod:`kvmgr.kernels.mla.insert` and ``memo``):
    guard_step      the guarded signature of a step: ``(check, has scales, (bound launch, grid,
                    ints), aligned, read, cells address or None, cells)``; ``check`` is its
                    tensor guard's

``read`` is :func:`kvmgr.kernels.launch.native.checked_data_ptrs` (``read(check, *tensors)``:
the verdict and every pointer in one C call) or, where the launch is packed and the C module
builds, :func:`kvmgr.kernels.launch.cells.cell_writer` (``read(address, check, known, *step)``: the verdict over
``(*known, *step)``, the ``known`` tensors' pointers compared with theirs, the two bases'
16-byte alignment with the guarded step's, and the step's pointers and ints written into the
launch's cells, in ONE C call; the pointers returned, None where anything refuses and nothing is
written). ``known``: a cache set's tensors (the public function's steady record) or ``()``; the
step: ``kv_c``, ``k_pe``, ``slot_mapping`` and, for a step with scales, ``kv_scales``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvmgr._tensor_guard import tensor_guard
from kvmgr.kernels.launch.cells import cell_writer
from kvmgr.kernels.launch.native import checked_data_ptrs

__all__ = ["guard_step"]

# the varying positions (kernel parameter order) of kv_c, k_pe, slot_mapping, kv_scales, and of
# the ints (T and the three layer strides): GroupedInsert's _VARYING without the pointer table
_POINTERS, _INTS, _SCALES = (0, 1, 3, 4), (5, 6, 7, 8), 4


def guard_step(
    tensors: Sequence[torch.Tensor], entry: tuple[Any, ...], aligned: bool,
    known: tuple[int, ...],
) -> tuple[Any, ...] | None:  # fmt: skip
    """The guarded signature (module docstring) of ``entry`` (a step signature's ``(bound
    launch, grid or None, ints)``) built from ``tensors``: ``len(known)`` tensors whose pointers
    must be ``known`` on each call, then the step's three or four tensors; ``aligned``: whether
    that step's ``kv_c`` and ``k_pe`` bases are 16-byte aligned. None where this torch has no
    guard that accepts them.

    Raises:
        OverflowError: an int of ``entry`` does not fit its cell (another specialization).
    """
    guard = tensor_guard(tensors)
    if guard is None:
        return None
    bound, grid, ints = entry
    scaled = len(tensors) - len(known) == 4
    write = cell_writer()
    if write is None or grid is None or not bound.is_packed:
        return (guard.check, scaled, entry, aligned, checked_data_ptrs(), None, None)
    words = [*zip(_INTS, ints, strict=True), *([] if scaled else [(_SCALES, None)])]
    cells = bound.step_cells(known, aligned, _POINTERS[: 4 if scaled else 3], words)
    return (guard.check, scaled, entry, aligned, write, cells.address, cells)
