"""A bound launch's step cells as the C writer of :mod:`kvmgr.kernels.launch.native` takes them.

Offers (to :mod:`kvmgr.kernels.launch.packed` and ``native``):
    StepCells   what ``native.cell_writer()(cells.address, check, *tensors)`` checks and writes:
                the pointers some tensors must have, the cells the others' pointers go to, the
                words written with them; in C memory (one ``uint64`` array)

Layout of the array: ``n_tensors, n_known, aligned, n_cells, n_words``, then the ``n_known``
pointers, the ``n_cells`` cell addresses and ``n_words`` pairs ``(address, word)``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

__all__ = ["StepCells"]


class StepCells:
    """What ``cell_writer()(cells.address, check, *tensors)`` checks and writes (C memory).

    Args:
        known: the pointers the first ``len(known)`` tensors must have (a cache set's).
        aligned: whether the next two tensors' bases must both be 16-byte aligned (True) or not.
        cells: the addresses the remaining tensors' pointers are written to, in order.
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
