"""Scatters of one value into an int64 array at many ids, and the LRU's leading-run checks,
in single C calls (private to :mod:`kvmgr.scheduler`; issue 27).

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

``live_run(log, stamp, head, n)``: ``stamp[log[head + i]] == head + i`` for every ``i < n``
(``BlockLru._leading``: the ``n`` log entries from the head all live), True or False; None
(undecided: numpy decides) for buffers of other kinds or a position outside them.
``chain_ok(run, state, ready, readers, up, kids)``: ``VictimSearch._leading_run``'s common
case, True when every block of ``run`` is ``ready`` without readers and the run is one chain,
its leaf first (``up[run[i]] == run[i + 1]``, ``kids`` 0 for the leaf and 1 for the others);
False otherwise, or for other buffers or a block outside them (numpy's path then decides).
``leaves_ok`` (the same arguments): 1 when every block is ``ready`` without readers and ``kids``
0 (no indexed child: any order is one offer at a time's), 2 when besides every ``up`` is negative
(no indexed parent either: the per-call stores' roots), 0 otherwise.
In the eviction round (``full``) the two took 21 us of numpy calls, 4 us now.

``tests/scheduler/test_ids_c.py`` runs each against its numpy path.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["built_once", "ids_c"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* a 1-D C-contiguous buffer of int64 (itemsize 8) or uint8 (1), or 0 (nothing held) */
static int view_of(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int flags) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    int ok = view->ndim == 1 && view->itemsize == itemsize && f != NULL;
    if (ok && itemsize == 8) ok = (!strcmp(f, "l") && sizeof(long) == 8) || !strcmp(f, "q");
    if (ok && itemsize == 1) ok = !strcmp(f, "B");
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
    if (!view_of(args[0], &dst, 8, PyBUF_WRITABLE)) return 0;
    if (!view_of(args[1], &at, 8, PyBUF_SIMPLE)) {
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

/* live_run(log, stamp, head, n): stamp[log[head + i]] == head + i for every i < n (True or
   False); None (undecided) for other buffers or a position outside them */
static PyObject *live_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "live_run(log, stamp, head, n)");
        return NULL;
    }
    Py_ssize_t head = PyLong_AsSsize_t(args[2]), n = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer log, stamp;
    if (!view_of(args[0], &log, 8, PyBUF_SIMPLE)) Py_RETURN_NONE;
    if (!view_of(args[1], &stamp, 8, PyBUF_SIMPLE)) {
        PyBuffer_Release(&log);
        Py_RETURN_NONE;
    }
    const int64_t *lg = (const int64_t *)log.buf, *st = (const int64_t *)stamp.buf;
    Py_ssize_t size = stamp.shape[0];
    int rc = head >= 0 && n >= 0 && head + n <= log.shape[0] ? 1 : -1;
    for (Py_ssize_t i = head; rc == 1 && i < head + n; i++) {
        int64_t b = lg[i];
        rc = b < 0 || b >= size ? -1 : st[b] == i;
    }
    PyBuffer_Release(&stamp);
    PyBuffer_Release(&log);
    if (rc < 0) Py_RETURN_NONE;
    return PyBool_FromLong(rc);
}

/* chain_ok(run, state, ready, readers, up, kids): True when every block b of run has
   state[b] == ready and readers[b] == 0, up[run[i]] == run[i + 1], kids[run[0]] == 0 and
   kids[run[i]] == 1 for i > 0 (one chain, its leaf first); False otherwise or for buffers of
   other kinds or a block outside them (the caller's numpy path decides). leaves_ok (same
   arguments): 1 when every block is READY without readers and kids[b] == 0, 2 when besides
   every up[b] < 0, else 0 */
static PyObject *run_ok(PyObject *const *args, Py_ssize_t nargs, int chain) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "chain_ok(run, state, ready, readers, up, kids)");
        return NULL;
    }
    long long ready = PyLong_AsLongLong(args[2]);
    if (ready == -1 && PyErr_Occurred()) return NULL;
    Py_buffer v[5];
    PyObject *objs[5] = {args[0], args[1], args[3], args[4], args[5]};
    Py_ssize_t sizes[5] = {8, 1, 8, 8, 8}, got = 0;
    while (got < 5 && view_of(objs[got], &v[got], sizes[got], PyBUF_SIMPLE)) got++;
    int ok = got == 5, roots = 1;
    if (ok) {
        const int64_t *run = v[0].buf, *readers = v[2].buf, *up = v[3].buf, *kids = v[4].buf;
        const uint8_t *state = v[1].buf;
        Py_ssize_t n = v[0].shape[0], size = v[1].shape[0];
        for (int k = 2; k < 5; k++) size = v[k].shape[0] < size ? v[k].shape[0] : size;
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            int64_t b = run[i];
            ok = b >= 0 && b < size && state[b] == ready && readers[b] == 0;
            if (ok && chain) ok = kids[b] == (i ? 1 : 0) && (i + 1 == n || up[b] == run[i + 1]);
            else if (ok) {
                ok = kids[b] == 0;
                roots &= up[b] < 0;
            }
        }
    }
    while (got > 0) PyBuffer_Release(&v[--got]);
    if (chain) return PyBool_FromLong(ok);
    return PyLong_FromLong(ok ? 1 + roots : 0);
}

static PyObject *chain_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return run_ok(args, nargs, 1);
}

static PyObject *leaves_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return run_ok(args, nargs, 0);
}

static PyMethodDef methods[] = {
    {"add_at", (PyCFunction)(void (*)(void))add_at, METH_FASTCALL, "add_at(target, ids, delta) -> bool"},
    {"set_at", (PyCFunction)(void (*)(void))set_at, METH_FASTCALL, "set_at(target, ids, value) -> bool"},
    {"live_run", (PyCFunction)(void (*)(void))live_run, METH_FASTCALL, "live_run(log, stamp, head, n) -> bool or None"},
    {"chain_ok", (PyCFunction)(void (*)(void))chain_ok, METH_FASTCALL, "chain_ok(run, state, ready, readers, up, kids) -> bool"},
    {"leaves_ok", (PyCFunction)(void (*)(void))leaves_ok, METH_FASTCALL, "leaves_ok(run, state, ready, readers, up, kids) -> 0, 1 or 2"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_ids", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_ids(void) { return PyModule_Create(&module); }
"""


_built: list[Any] = []  #: the module (or None) once built or found missing


def ids_c() -> Any:
    """The module (module docstring), built once torch is loaded; None where it cannot be
    built, and (without building) while torch is not loaded (as :func:`kvmgr._index_c.index_c`)."""
    return built_once(_built, _SOURCE, "kvmgr_ids")


def built_once(built: list[Any], source: str, name: str) -> Any:
    """``built[0]``, or (torch loaded, ``built`` empty) the module ``name`` built from
    ``source`` and kept in ``built`` (None where it does not build); None while torch is not
    loaded (nothing kept: a later call builds)."""
    if built:
        return built[0]
    if "torch" not in sys.modules:
        return None
    from kvmgr._native import build

    built.append(build(source, name))
    return built[0]
