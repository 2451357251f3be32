"""The driver's copy entry points called from C (private to ``kvmgr.transfer``).

Offers:
    native_call     ``call(entry, *args) -> CUresult``: the C function at address ``entry`` called
                    with its 2, 3, 4, 8 or 9 pointer-sized integer arguments, the GIL released;
                    None where the module cannot be built
    native_fence_start  ``fence_start(record, wait, fence, current, copy, start)``: a batch's
                    fence record, its wait and its start record in one C call (None likewise)
    native_fenced_batch  those three, one ``cuMemcpyBatchAsync`` and the end record in one C
                    call (None likewise)

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

from kvmgr._native import build

__all__ = ["native_call", "native_fence_start", "native_fenced_batch"]

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

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "call(entry, *args) -> the entry point's result"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_driver_call", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_driver_call(void) { return PyModule_Create(&module); }
"""


@functools.cache
def native_call() -> Any:
    """The C ``call`` function (module docstring), built once per process; None where it
    cannot be (or ``KVMGR_NATIVE_LAUNCH=0``)."""
    if os.environ.get("KVMGR_NATIVE_LAUNCH", "1") == "0":
        return None
    try:
        from triton.runtime.build import compile_module_from_src

        return compile_module_from_src(_SOURCE, "kvmgr_driver_call").call
    except Exception:  # no Triton, no C compiler, no Python headers: the ctypes calls
        return None


_FENCE_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef uint64_t u64;
typedef int (*record_t)(u64, u64);     /* cuEventRecord(event, stream) */
typedef int (*wait_t)(u64, u64, u64);  /* cuStreamWaitEvent(stream, event, flags) */

/* the `want` arguments as 64-bit values into a, the first `entries` of them non-NULL entry
   points; 0, or -1 with a Python error set */
static int read_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int entries,
                     u64 *a, const char *usage) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        a[i] = PyLong_AsUnsignedLongLongMask(args[i]);
        if (a[i] == (u64)-1 && PyErr_Occurred()) return -1;
    }
    for (int i = 0; i < entries; i++) {
        if (a[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "a NULL entry point");
            return -1;
        }
    }
    return 0;
}

/* e = {cuEventRecord, cuStreamWaitEvent}, f = {fence, current, copy, start}: record the fence
   on current, make copy wait on it, record start on copy; stops at the first nonzero CUresult
   (returned, its step in *step; 0 when all three were made). Called without the GIL. */
static int fence_steps(const u64 *e, const u64 *f, int *step) {
    record_t record = (record_t)(uintptr_t)e[0];
    int code;
    *step = 0;
    code = record(f[0], f[1]);
    if (code == 0) { *step = 1; code = ((wait_t)(uintptr_t)e[1])(f[2], f[0], 0); }
    if (code == 0) { *step = 2; code = record(f[3], f[2]); }
    return code;
}

/* fence_start(record, wait, fence, current, copy, start): cuEventRecord(fence, current),
   cuStreamWaitEvent(copy, fence, 0), cuEventRecord(start, copy), in this order, the GIL released
   once; stops at the first nonzero CUresult. Returns 0 (all three enqueued) or
   step * 65536 + code: the step (0, 1, 2) the driver refused with ``code``, the earlier ones
   enqueued, the later ones not called. */
static PyObject *fence_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    u64 a[6];
    if (read_args(args, nargs, 6, 2, a, "fence_start(record, wait, fence, current, copy, start)"))
        return NULL;
    int step, code;
    Py_BEGIN_ALLOW_THREADS
    code = fence_steps(a, a + 2, &step);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code == 0 ? 0 : step * 65536L + (code & 0xFFFF));
}

typedef int (*batch8_t)(u64, u64, u64, u64, u64, u64, u64, u64);
typedef int (*batch9_t)(u64, u64, u64, u64, u64, u64, u64, u64, u64);

/* fenced_batch(record, wait, batch, fence, current, copy, start, end, dsts, srcs, sizes, count,
   attrs, attrs_idxs, fail_idx): fence_start's three calls, then cuMemcpyBatchAsync(dsts, srcs,
   sizes, count, attrs, attrs_idxs, 1, [fail_idx,] copy) (the 12.8 ABI's 9 arguments where
   fail_idx is not 0: *fail_idx set to SIZE_MAX first; else the 13.0 ABI's 8), then
   cuEventRecord(end, copy); the GIL released once, stopping at the first nonzero CUresult.
   Returns 0 or step * 65536 + code, steps 0-4 in that order. */
static PyObject *fenced_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    u64 a[15];
    if (read_args(args, nargs, 15, 3, a, "fenced_batch takes 15 arguments")) return NULL;
    record_t record = (record_t)(uintptr_t)a[0];
    int step, code;
    Py_BEGIN_ALLOW_THREADS
    code = fence_steps(a, a + 3, &step);
    if (code == 0) {
        step = 3;
        if (a[14] != 0) {
            *(size_t *)(uintptr_t)a[14] = (size_t)-1;
            code = ((batch9_t)(uintptr_t)a[2])(a[8], a[9], a[10], a[11], a[12], a[13], 1, a[14], a[5]);
        } else {
            code = ((batch8_t)(uintptr_t)a[2])(a[8], a[9], a[10], a[11], a[12], a[13], 1, a[5]);
        }
    }
    if (code == 0) { step = 4; code = record(a[7], a[5]); }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code == 0 ? 0 : step * 65536L + (code & 0xFFFF));
}

static PyMethodDef methods[] = {
    {"fence_start", (PyCFunction)(void (*)(void))fence_start, METH_FASTCALL,
     "fence_start(record, wait, fence, current, copy, start) -> 0 or step * 65536 + code"},
    {"fenced_batch", (PyCFunction)(void (*)(void))fenced_batch, METH_FASTCALL,
     "fenced_batch(record, wait, batch, fence, current, copy, start, end, dsts, srcs, sizes, "
     "count, attrs, attrs_idxs, fail_idx) -> 0 or step * 65536 + code"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_fence_start", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_fence_start(void) { return PyModule_Create(&module); }
"""


@functools.cache
def _fence_module() -> Any:
    """The ``_FENCE_SOURCE`` module, built once per process (``kvmgr._native.build``); None
    where it cannot be (or ``KVMGR_NATIVE_LAUNCH=0``). Its own module: ``native_call``'s build
    (in Triton's cache) stays as it was."""
    return build(_FENCE_SOURCE, "kvmgr_fence_start")


def native_fence_start() -> Any:
    """The C ``fence_start`` (a batch's fence record, the copy stream's wait on it and the
    start record in one C call; ``_FENCE_SOURCE``), or None."""
    module = _fence_module()
    return None if module is None else module.fence_start


def native_fenced_batch() -> Any:
    """The C ``fenced_batch`` (``fence_start``'s calls, one ``cuMemcpyBatchAsync`` and the end
    record in one C call; ``_FENCE_SOURCE``), or None."""
    module = _fence_module()
    return None if module is None else module.fenced_batch
