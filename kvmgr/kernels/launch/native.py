"""The driver call of a packed launch from C: one Python-level call, no ctypes argument passing.

Offers (to the rest of :mod:`kvmgr.kernels.launch`, and ``checked_data_ptrs`` to the kernels'
owners):
    native_fire     ``fire(record_address) -> CUresult``, or None where it cannot be built
    Record          a launch record: the entry point and its three arguments, in C memory
    checked_data_ptrs   :func:`kvmgr._native.checked_data_ptrs`, re-exported: their
                    ``data_ptr()``s where a tensor guard's ``check`` accepts them, else None
    (the C ``write_cells``: :func:`kvmgr.kernels.launch.cells.cell_writer`)

Why: a ctypes call of ``cuLaunchKernelEx`` prepares a libffi call and converts its four arguments
on every launch (0.5-0.9 us of host time on the 2-core CPU machine, the stub driver's whole
row in ``kvmgr bench launch-host``). ``fire`` is a ``METH_O`` function of a tiny C module: it reads
the record (``launch``, ``config``, ``function``, ``params``) and calls
``launch(config, function, params, NULL)`` with the GIL released, as ctypes and Triton's own
launcher do.

The C module is kvmgr's one (:mod:`kvmgr._native`, shared with the worker's moved-tensor check,
which must not import the kernels): compiled once per machine by Triton's own helper for its
launchers, the first time it is asked for. Anything that fails there (no compiler, another
Triton) leaves :func:`native_fire` None and packed launches on the ctypes call: the same launch.
``KVMGR_NATIVE_LAUNCH=0`` in the environment keeps the ctypes call (a way around a platform where
the module misbehaves, and the baseline of the A/B in ``scripts/gpu/launchhost.sh``).
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvmgr._native import c_module, checked_data_ptrs

__all__ = ["Record", "checked_data_ptrs", "native_fire"]


class Record:
    """One launch's record in C memory: ``address`` is what :func:`native_fire` takes.

    Args:
        launch: the address of a ``cuLaunchKernelEx``-shaped C function.
        config, function, params: its first three arguments (addresses; the fourth is NULL).

    The caller keeps the memory behind ``config`` and ``params`` alive as long as the record.
    """

    def __init__(self, launch: int, config: int, function: int, params: int) -> None:
        self._cells = (ctypes.c_uint64 * 4)(launch, config, function, params)
        self.address = ctypes.addressof(self._cells)


def native_fire() -> Any:
    """The C ``fire`` function (module docstring), built once; None where it cannot be."""
    module = c_module()
    return None if module is None else module.fire
