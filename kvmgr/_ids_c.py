"""Scatters of one value into an int64 array at many ids, in single C calls (private to
:mod:`kvmgr.scheduler`; issue 27).

Offers ``ids_c``: the compiled module (below), built once; None where kvmgr's C modules do not
build (no Triton, no compiler, ``KVMGR_NATIVE_LAUNCH=0``) or torch is not loaded: every caller
then takes its numpy path, which computes the same. A batched store of 512 blocks writes its
GPU ids' busy counts (``GpuBlocks.acquire``), its queue marks (``SwapQueue.add``) and, at its
landing, the busy counts again (``GpuBlocks.release``): numpy's fancy indexing costs 0.9-2.3 us
per call for 512 ids (index checks, a gather and a scatter), a C loop ~0.3.

``add_at(target, ids, delta)``: ``target[ids[i]] += delta`` for each ``i`` in order (as
``np.add.at``: a repeated id counts each time); ``set_at(target, ids, value)``:
``target[ids] = value``. ``target``: a writable 1-D C-contiguous int64 buffer (a numpy array, an
``array.array("q")``), ``ids`` a 1-D C-contiguous int64 buffer, ``delta``/``value`` an int.
Both return True; False, with nothing written, for buffers of other kinds or an id outside
``[0, len(target))`` (the caller's numpy path then decides and raises its ``IndexError``).

``tests/scheduler/test_ids_c.py`` runs each against its numpy path.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ids_c"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int int64_view(PyObject *obj, Py_buffer *view, int flags) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    int ok = view->ndim == 1 && view->itemsize == 8 && f != NULL &&
             ((!strcmp(f, "l") && sizeof(long) == 8) || !strcmp(f, "q"));
    if (!ok) PyBuffer_Release(view);
    return ok;
}

/* target[ids[i]] (+)= value for each i: 1 (done) or 0 (nothing written), -1 on an error */
static int scatter(PyObject *const *args, Py_ssize_t nargs, int add) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "scatter(target, ids, value)");
        return -1;
    }
    long long value = PyLong_AsLongLong(args[2]);
    if (value == -1 && PyErr_Occurred()) return -1;
    Py_buffer dst, at;
    if (!int64_view(args[0], &dst, PyBUF_WRITABLE)) return 0;
    if (!int64_view(args[1], &at, PyBUF_SIMPLE)) {
        PyBuffer_Release(&dst);
        return 0;
    }
    int64_t *cells = (int64_t *)dst.buf;
    const int64_t *pos = (const int64_t *)at.buf;
    Py_ssize_t n = at.shape[0], size = dst.shape[0];
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) ok = pos[i] >= 0 && pos[i] < size;
    if (ok && add)
        for (Py_ssize_t i = 0; i < n; i++) cells[pos[i]] += value;
    else if (ok)
        for (Py_ssize_t i = 0; i < n; i++) cells[pos[i]] = value;
    PyBuffer_Release(&at);
    PyBuffer_Release(&dst);
    return ok;
}

static PyObject *add_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int rc = scatter(args, nargs, 1);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *set_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int rc = scatter(args, nargs, 0);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"add_at", (PyCFunction)(void (*)(void))add_at, METH_FASTCALL, "add_at(target, ids, delta) -> bool"},
    {"set_at", (PyCFunction)(void (*)(void))set_at, METH_FASTCALL, "set_at(target, ids, value) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_ids", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_ids(void) { return PyModule_Create(&module); }
"""


_built: list[Any] = []  #: the module (or None) once built or found missing


def ids_c() -> Any:
    """The module (module docstring), built once torch is loaded; None where it cannot be
    built, and (without building) while torch is not loaded (as :func:`kvmgr._index_c.index_c`)."""
    if _built:
        return _built[0]
    if "torch" not in sys.modules:
        return None
    from kvmgr._native import build

    _built.append(build(_SOURCE, "kvmgr_ids"))
    return _built[0]
