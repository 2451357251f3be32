"""The driver call of a packed launch from C: one Python-level call, no ctypes argument passing.

Offers (to the rest of :mod:`kvmgr.kernels.launch`):
    native_fire     ``fire(record_address) -> CUresult``, or None where it cannot be built
    Record          a launch record: the entry point and its three arguments, in C memory

Why: a ctypes call of ``cuLaunchKernelEx`` prepares a libffi call and converts its four arguments
on every launch (0.5-0.9 us of host time on the 2-core CPU machine, the stub driver's whole
row in ``kvmgr bench launch-host``). ``fire`` is a ``METH_O`` function of a tiny C module: it reads
the record (``launch``, ``config``, ``function``, ``params``) and calls
``launch(config, function, params, NULL)`` with the GIL released, as ctypes and Triton's own
launcher do.

The module is compiled once per machine by Triton's own helper for its launchers
(``triton.runtime.build.compile_module_from_src``: the system C compiler, Triton's cache), the
first time a packed launch is bound. Anything that fails there (no compiler, another Triton)
leaves :func:`native_fire` None and packed launches on the ctypes call: the same launch.
``KVMGR_NATIVE_LAUNCH=0`` in the environment keeps the ctypes call (a way around a platform where
the module misbehaves, and the baseline of the A/B in ``scripts/gpu/launchhost.sh``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

__all__ = ["Record", "native_fire"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*launch_t)(void *, void *, void **, void **);

/* arg: the address of a record {launch, config, function, params} of four 8-byte cells */
static PyObject *fire(PyObject *self, PyObject *arg) {
    void **record = (void **)PyLong_AsVoidPtr(arg);
    if (record == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fire: a NULL launch record");
        return NULL;
    }
    launch_t launch = (launch_t)record[0];
    int result;
    Py_BEGIN_ALLOW_THREADS
    result = launch(record[1], record[2], (void **)record[3], NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"fire", fire, METH_O, "fire(record_address) -> the launch entry point's result"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_fire", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_fire(void) { return PyModule_Create(&module); }
"""


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


@functools.cache
def native_fire() -> Any:
    """The C ``fire`` function (module docstring), built once; None where it cannot be."""
    if os.environ.get("KVMGR_NATIVE_LAUNCH", "1") == "0":
        return None
    try:
        from triton.runtime.build import compile_module_from_src

        return compile_module_from_src(_SOURCE, "kvmgr_fire").fire
    except Exception:  # no C compiler, no Python headers, another Triton: the ctypes call
        return None
