"""The driver's copy entry points called from C (private to ``kvmgr.transfer``).

Offers:
    native_call     ``call(entry, *args) -> CUresult``: the C function at address ``entry`` called
                    with its 2, 3, 4, 8 or 9 pointer-sized integer arguments, the GIL released;
                    None where the module cannot be built
    native_context  ``context(entry) -> handle | None``: ``cuCtxGetCurrent`` at ``entry`` from C
                    (``cuda_current.device_check``: the current device in one read)

Why: a ctypes call of ``cuMemcpyBatchAsync`` (8 or 9 arguments, each converted by its
``argtypes``, then libffi) is 4-5 us hot on the 2-core CPU machine but 40-47 us with the caches
cold, as a step finds them after its store calls (the stub driver, ``scripts/step_pieces.py``);
this module's ``call`` is 1.7 us hot and 10-13 us cold. ``call`` is a ``METH_FASTCALL`` function:
it reads its arguments as unsigned 64-bit integers (``PyLong_AsUnsignedLongLongMask``: every
argument of these entry points is a pointer, ``size_t``, ``CUdeviceptr`` or ``CUstream``, one
64-bit integer register or stack slot on LP64) and calls the entry point through a prototype of
that many such arguments returning ``int`` (``CUresult``), with the GIL released as ctypes does.

The module is compiled once per machine by Triton's helper for its launchers
(``triton.runtime.build.compile_module_from_src``: the system C compiler, Triton's cache), as
:mod:`kvmgr.kernels.launch.native` is. Anything that fails there (no Triton, no compiler) leaves
:func:`native_call` None and the driver on its ctypes calls; ``KVMGR_NATIVE_LAUNCH=0`` in the
environment does too (the kill switch of the C launch, one for both).
"""

from __future__ import annotations

import functools
import os
from typing import Any

__all__ = ["native_call", "native_context"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef uint64_t u64;
typedef int (*call2_t)(u64, u64);
typedef int (*call3_t)(u64, u64, u64);
typedef int (*call4_t)(u64, u64, u64, u64);
typedef int (*call8_t)(u64, u64, u64, u64, u64, u64, u64, u64);
typedef int (*call9_t)(u64, u64, u64, u64, u64, u64, u64, u64, u64);

/* call(entry, *args): entry(*args) for 2, 3, 4, 8 or 9 integer arguments, the GIL released */
static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    u64 a[10];
    Py_ssize_t n = nargs - 1;
    if (n != 2 && n != 3 && n != 4 && n != 8 && n != 9) {
        PyErr_SetString(PyExc_TypeError, "call(entry, *args): 2, 3, 4, 8 or 9 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        a[i] = PyLong_AsUnsignedLongLongMask(args[i]);
        if (a[i] == (u64)-1 && PyErr_Occurred()) return NULL;
    }
    if (a[0] == 0) {
        PyErr_SetString(PyExc_ValueError, "call: a NULL entry point");
        return NULL;
    }
    int result;
    Py_BEGIN_ALLOW_THREADS
    if (n == 2) result = ((call2_t)(uintptr_t)a[0])(a[1], a[2]);
    else if (n == 3) result = ((call3_t)(uintptr_t)a[0])(a[1], a[2], a[3]);
    else if (n == 4) result = ((call4_t)(uintptr_t)a[0])(a[1], a[2], a[3], a[4]);
    else if (n == 8) result = ((call8_t)(uintptr_t)a[0])(a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8]);
    else result = ((call9_t)(uintptr_t)a[0])(a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* context(entry): entry(&handle) for cuCtxGetCurrent (a read of the thread's current context,
   the GIL kept): the handle as an int (0: none current), or None where the driver refused */
typedef int (*get1_t)(void **);
static PyObject *context(PyObject *self, PyObject *entry) {
    u64 at = PyLong_AsUnsignedLongLongMask(entry);
    if (at == (u64)-1 && PyErr_Occurred()) return NULL;
    if (at == 0) {
        PyErr_SetString(PyExc_ValueError, "context: a NULL entry point");
        return NULL;
    }
    void *handle = NULL;
    if (((get1_t)(uintptr_t)at)(&handle) != 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong((u64)(uintptr_t)handle);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "call(entry, *args) -> the entry point's result"},
    {"context", context, METH_O, "context(entry) -> the current context's handle, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_driver_call", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_driver_call(void) { return PyModule_Create(&module); }
"""


@functools.cache
def _module() -> Any:
    if os.environ.get("KVMGR_NATIVE_LAUNCH", "1") == "0":
        return None
    try:
        from triton.runtime.build import compile_module_from_src

        return compile_module_from_src(_SOURCE, "kvmgr_driver_call")
    except Exception:  # no Triton, no C compiler, no Python headers: the ctypes calls
        return None


def native_call() -> Any:
    """The C ``call`` function (module docstring), built once per process; None where it
    cannot be (or ``KVMGR_NATIVE_LAUNCH=0``)."""
    module = _module()
    return None if module is None else module.call


def native_context() -> Any:
    """The C ``context(entry)`` function: ``cuCtxGetCurrent`` at ``entry`` called from C with
    the GIL kept (a read of the calling thread's current context): the handle as an int (0:
    none current), or None where the driver refused the call. None where the module cannot
    be built (as ``native_call``)."""
    module = _module()
    return None if module is None else module.context
