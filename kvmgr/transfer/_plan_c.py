"""The plan's arithmetic in single C calls (private to :mod:`kvmgr.transfer._runs` and
:mod:`kvmgr.transfer._pairs`).

Offers:
    sort_pairs      ``sort_pairs()(s, d, num_src, num_dst, s_out, d_out) -> code``: the checks
                    and the stable sort of ``find_runs``' merged pairs; None where kvmgr's C
                    modules do not build
    fill_run        ``fill_run()(matrix, out, s, d, length) -> bool``: one run's descriptors
                    (``_Tensors.fill_one``); None where they do not build

Why: a step's plan finds the CPU caches cold after the step's store calls, where each numpy call
costs microseconds; the merged plan of scattered pairs is a stable argsort, two gathers, a range
check and two differences (30 us of a 512-pair step on the 2-core CPU host), consecutive pairs
two byte compares with a cached range, one run's descriptors an ``np.array`` and an ``np.dot``.

``sort_pairs(s, d, num_src, num_dst, s_out, d_out)``: ``s``, ``d`` are 1-D C-contiguous int64
buffers of ``n >= 2`` ids each; ``s_out``, ``d_out`` writable C-contiguous int64 buffers of ``n``,
or both None. Returns:

- ``0``: ``s`` and ``d`` are each ``first, first + 1, ...`` inside ``[0, num_src)`` /
  ``[0, num_dst)`` (one run; nothing written);
- ``3``: not that, and the outputs are None (call again with them);
- ``1`` or ``2``: every id is in range and no destination repeats; the pairs sorted by source
  id (stable: equal sources keep their order; an LSD radix sort by bytes) are written to
  ``s_out`` / ``d_out``; ``1`` when no two neighbours continue each other on both sides (every
  pair its own run), ``2`` when some do;
- ``-1``: anything else (an id out of range, a repeated destination, buffers of another kind or
  size): nothing is decided, the caller's numpy path decides (and words its error).

``fill_run(matrix, out, s, d, length)``: ``out[i] = matrix[i] @ (s, d, length, 1)`` for every row
of ``matrix`` (2-D int64 ``[R, 4]``) into ``out`` (int64, ``R`` items), in wrapping 64-bit arithmetic
as numpy's; False (nothing written) where a buffer is of another kind or size.

Exactly what the numpy paths compute for the same input (``tests/transfer/test_plan_c.py`` runs
both); built once per machine by :func:`kvmgr._native.build` (``KVMGR_NATIVE_LAUNCH=0``: never).
"""

from __future__ import annotations

import functools
from typing import Any

from kvmgr._native import build

__all__ = ["fill_run", "sort_pairs"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int is_range(const int64_t *ids, Py_ssize_t n, long long num) {
    int64_t first = ids[0];
    if (first < 0 || first > num - n) return 0; /* first + n <= num, without overflow */
    for (Py_ssize_t i = 1; i < n; i++)
        if (ids[i] != first + i) return 0;
    return 1;
}

/* idx[0:n] (0, 1, ..., n - 1) sorted by key[idx] (every key in [0, num)), stably: an LSD radix
   sort by bytes (each pass stable), as many passes as num - 1 has bytes; tmp: scratch of n.
   The result is in idx. */
static void sort_by(const int64_t *key, Py_ssize_t *idx, Py_ssize_t *tmp, Py_ssize_t n,
                    long long num) {
    Py_ssize_t count[256];
    Py_ssize_t *from = idx, *to = tmp;
    for (int shift = 0; shift < 64 && ((unsigned long long)(num - 1) >> shift); shift += 8) {
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < n; i++) count[(key[from[i]] >> shift) & 255]++;
        Py_ssize_t total = 0;
        for (int b = 0; b < 256; b++) {
            Py_ssize_t c = count[b];
            count[b] = total;
            total += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) to[count[(key[from[i]] >> shift) & 255]++] = from[i];
        Py_ssize_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != idx) memcpy(idx, from, (size_t)n * sizeof(Py_ssize_t));
}

static int cmp_i64(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* in range [0, num) and no repeats */
static int distinct_in_range(const int64_t *ids, Py_ssize_t n, long long num) {
    int increasing = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num) return 0;
        if (i && ids[i] <= ids[i - 1]) increasing = 0;
    }
    if (increasing) return 1;
    int64_t *copy = malloc((size_t)n * sizeof(int64_t));
    if (copy == NULL) return -1;
    memcpy(copy, ids, (size_t)n * sizeof(int64_t));
    qsort(copy, (size_t)n, sizeof(int64_t), cmp_i64);
    int ok = 1;
    for (Py_ssize_t i = 1; i < n && ok; i++)
        if (copy[i] == copy[i - 1]) ok = 0;
    free(copy);
    return ok;
}

/* s -> d in range, no destination twice: sorted by s (stably) into s_out, d_out; 1 or 2 */
static int sort_valid(const int64_t *s, const int64_t *d, Py_ssize_t n, long long num_src,
                      long long num_dst, int64_t *s_out, int64_t *d_out) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < 0 || s[i] >= num_src) return -1;
    int distinct = distinct_in_range(d, n, num_dst);
    if (distinct <= 0) return -1;
    Py_ssize_t *idx = malloc(2 * (size_t)n * sizeof(Py_ssize_t));
    if (idx == NULL) return -1;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        idx[i] = i;
        if (i && s[i] < s[i - 1]) sorted = 0;
    }
    if (!sorted) sort_by(s, idx, idx + n, n, num_src);
    int merges = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        s_out[i] = s[idx[i]];
        d_out[i] = d[idx[i]];
        if (i && s_out[i] - s_out[i - 1] == 1 && d_out[i] - d_out[i - 1] == 1) merges = 1;
    }
    free(idx);
    return merges ? 2 : 1;
}

/* a C-contiguous buffer of int64 (native order), of n items where n >= 0; 1, or 0 (released) */
static int get(PyObject *obj, Py_buffer *view, int flags, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    if (f && (*f == '@' || *f == '=' || *f == '<')) f++;
    if (view->itemsize != 8 || f == NULL || (strcmp(f, "l") && strcmp(f, "q"))
        || (n >= 0 && view->len != n * 8)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static PyObject *sort_pairs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "sort_pairs(s, d, num_src, num_dst, s_out, d_out)");
        return NULL;
    }
    long long num_src = PyLong_AsLongLong(args[2]), num_dst = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer bs, bd, bso, bdo;
    long code = -1;
    if (!get(args[0], &bs, 0, -1)) return PyLong_FromLong(-1);
    Py_ssize_t n = bs.len / 8;
    if (bs.ndim != 1 || n < 2 || !get(args[1], &bd, 0, n)) goto no_d;
    if (bd.ndim != 1) goto no_so;
    if (is_range(bd.buf, n, num_dst) && is_range(bs.buf, n, num_src)) {
        code = 0;
        goto no_so;
    }
    if (args[4] == Py_None && args[5] == Py_None) {
        code = 3;
        goto no_so;
    }
    if (!get(args[4], &bso, PyBUF_WRITABLE, n)) goto no_so;
    if (!get(args[5], &bdo, PyBUF_WRITABLE, n)) goto no_do;
    code = sort_valid(bs.buf, bd.buf, n, num_src, num_dst, bso.buf, bdo.buf);
    PyBuffer_Release(&bdo);
no_do:
    PyBuffer_Release(&bso);
no_so:
    PyBuffer_Release(&bd);
no_d:
    PyBuffer_Release(&bs);
    return PyLong_FromLong(code);
}

/* fill_run(matrix, out, s, d, length): out[i] = matrix[i] . (s, d, length, 1) for the
   3 * T rows of matrix (int64 [3 * T, 4]) into out (int64, 3 * T items), wrapping as numpy's
   int64 arithmetic does; True, or False where a buffer is of another kind or size */
static PyObject *fill_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fill_run(matrix, out, s, d, length)");
        return NULL;
    }
    unsigned long long run[4] = {0, 0, 0, 1};
    for (int k = 0; k < 3; k++) {
        run[k] = (unsigned long long)PyLong_AsLongLong(args[2 + k]);
        if (PyErr_Occurred()) return NULL;
    }
    Py_buffer bm, bo;
    if (!get(args[0], &bm, 0, -1)) Py_RETURN_FALSE;
    Py_ssize_t rows = bm.ndim == 2 && bm.shape[1] == 4 ? bm.shape[0] : -1;
    if (rows < 0 || !get(args[1], &bo, PyBUF_WRITABLE, rows)) {
        PyBuffer_Release(&bm);
        Py_RETURN_FALSE;
    }
    const unsigned long long *m = bm.buf;
    unsigned long long *out = bo.buf;
    for (Py_ssize_t i = 0; i < rows; i++, m += 4)
        out[i] = m[0] * run[0] + m[1] * run[1] + m[2] * run[2] + m[3];
    PyBuffer_Release(&bo);
    PyBuffer_Release(&bm);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"sort_pairs", (PyCFunction)(void (*)(void))sort_pairs, METH_FASTCALL,
     "sort_pairs(s, d, num_src, num_dst, s_out, d_out) -> 0, 1, 2, 3 or -1"},
    {"fill_run", (PyCFunction)(void (*)(void))fill_run, METH_FASTCALL,
     "fill_run(matrix, out, s, d, length) -> whether it wrote out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_plan", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_plan(void) { return PyModule_Create(&module); }
"""


@functools.cache
def _module() -> Any:
    return build(_SOURCE, "kvmgr_plan")


def sort_pairs() -> Any:
    """The C ``sort_pairs`` (module docstring), built once; None where it cannot be."""
    module = _module()
    return None if module is None else module.sort_pairs


def fill_run() -> Any:
    """The C ``fill_run`` (module docstring), built once; None where it cannot be."""
    module = _module()
    return None if module is None else module.fill_run
