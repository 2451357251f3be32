"""A bound launch's step cells as the C writer of :mod:`kvmgr._native` takes them.

Offers (to :mod:`kvmgr.kernels.launch.packed` and the kernels' owners):
    StepCells   what ``cell_writer()(cells.address, check, known, *step)`` checks and
                writes: the pointers the known tensors must have, the cells the step tensors'
                pointers go to, the words written with them; in C memory (one ``uint64`` array)
    cell_writer ``write_cells`` of the C module of :mod:`kvmgr._native` (that
                check of ``(*known, *step)``, the known pointers compared, the step's written
                and returned, in one call), or None where it does not build

Layout of the array: ``n_tensors, n_known, aligned, n_cells, n_words``, then the ``n_known``
pointers, the ``n_cells`` cell addresses and ``n_words`` pairs ``(address, word)``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from kvmgr._native import c_module, checked_data_ptrs

__all__ = ["StepCells", "cell_writer"]


class StepCells:
    """What ``cell_writer()(cells.address, check, known, *step)`` checks and writes (C memory).

    Args:
        known: the pointers the ``known`` tensors must have (a cache set's).
        aligned: whether the first two step tensors' bases must both be 16-byte aligned or not.
        cells: the addresses the step tensors' pointers are written to, in order.
        words: ``(address, 8-byte word)`` pairs written after them (a step's packed ints).
        owner: what keeps the memory behind ``cells`` and ``words`` alive (the bound launch).
    """

    def __init__(self, known: Sequence[int], aligned: bool, cells: Sequence[int], words: Sequence[tuple[int, int]], owner: object) -> None:  # fmt: skip
        flat = [len(known) + len(cells), len(known), int(aligned), len(cells), len(words),
                *known, *cells, *(part for pair in words for part in pair)]  # fmt: skip
        self._spec = (ctypes.c_uint64 * len(flat))(*flat)
        self.address = ctypes.addressof(self._spec)
        self.num_tensors = len(known) + len(cells)
        self._owner = owner


@functools.cache
def cell_writer() -> Callable[..., tuple[int, ...] | None] | None:
    """``write(cells.address, check, known, *step)`` (a
    :class:`~kvmgr.kernels.launch.cells.StepCells`; ``known``: a tuple or list of tensors):
    where ``check(*known, *step)`` is True, the known tensors' pointers are the cells' and the
    alignment is as given, the ``step`` tensors' ``data_ptr()``s written to their cells and the
    words to theirs, and those pointers returned; else None, nothing written. ONE C call; None where :func:`checked_data_ptrs` is
    not the C one or a probe write disagrees (callers then read and pack in Python)."""
    module = c_module()
    if module is None or checked_data_ptrs() is not getattr(module, "checked_ptrs", None):
        return None
    try:
        words = torch.empty(8, dtype=torch.int64)
        out = (ctypes.c_uint64 * 3)()
        cells = StepCells([words.data_ptr()], True, [ctypes.addressof(out)], [(ctypes.addressof(out) + 8, 7)], out)  # fmt: skip
        agree = lambda *tensors: len(tensors) == 2  # noqa: E731
        shifted = words[1:]
        got = module.write_cells(cells.address, agree, (words,), shifted)
        if got == (shifted.data_ptr(),) and list(out) == [shifted.data_ptr(), 7, 0]:
            return module.write_cells  # type: ignore[no-any-return]
    except Exception:  # another module or torch: the Python reads
        pass
    return None
