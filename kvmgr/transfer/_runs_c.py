"""``find_runs``' common cases in one C call (private to :mod:`kvmgr.transfer._runs`).

Offers:
    sort_pairs      ``sort_pairs()(s, d, num_src, num_dst, s_out, d_out) -> code``, the C
                    function, or None where kvmgr's C modules do not build

Why: a step's plan finds the CPU caches cold after the step's store calls, where each numpy call
costs microseconds; the merged plan of scattered pairs is a stable argsort, two gathers, a range
check and two differences (30 us of a 512-pair step on the 2-core CPU host), consecutive pairs
two byte compares with a cached range. This function does either in one pass of C over the ids.

``sort_pairs(s, d, num_src, num_dst, s_out, d_out)``: ``s``, ``d`` are C-contiguous int64 buffers
of ``n >= 2`` ids each, ``s_out``, ``d_out`` writable C-contiguous int64 buffers of ``n``.
Returns:

- ``0``: ``s`` and ``d`` are each ``first, first + 1, ...`` inside ``[0, num_src)`` /
  ``[0, num_dst)`` (one run; nothing written);
- ``1`` or ``2``: every id is in range and no destination repeats; the pairs sorted by source
  id (stable: equal sources keep their order) are written to ``s_out`` / ``d_out``; ``1`` when no
  two neighbours continue each other on both sides (every pair its own run), ``2`` when some do;
- ``-1``: anything else (an id out of range, a repeated destination, buffers of another kind or
  size): nothing is decided, the caller's Python path decides (and words its error).

Exactly what the numpy path computes for the same input (``tests/transfer/test_plan.py`` runs
both); built once per machine by :func:`kvmgr._native.build`.
"""

from __future__ import annotations

import functools
from typing import Any

from kvmgr._native import build

__all__ = ["sort_pairs"]

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

static int decide(const int64_t *s, const int64_t *d, Py_ssize_t n, long long num_src,
                  long long num_dst, int64_t *s_out, int64_t *d_out) {
    if (is_range(d, n, num_dst) && is_range(s, n, num_src)) return 0;
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

static int get(PyObject *obj, Py_buffer *view, int flags, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    if (f && (*f == '<' || *f == '=' || *f == '@')) f++;
    if (view->itemsize != 8 || view->ndim != 1 || f == NULL || (strcmp(f, "l") && strcmp(f, "q"))
        || (n >= 0 && view->shape[0] != n)) {
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
    if (!get(args[0], &bs, PyBUF_C_CONTIGUOUS, -1)) return PyLong_FromLong(-1);
    Py_ssize_t n = bs.shape[0];
    if (n < 2 || !get(args[1], &bd, PyBUF_C_CONTIGUOUS, n)) goto no_d;
    if (!get(args[4], &bso, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, n)) goto no_so;
    if (!get(args[5], &bdo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, n)) goto no_do;
    code = decide(bs.buf, bd.buf, n, num_src, num_dst, bso.buf, bdo.buf);
    PyBuffer_Release(&bdo);
no_do:
    PyBuffer_Release(&bso);
no_so:
    PyBuffer_Release(&bd);
no_d:
    PyBuffer_Release(&bs);
    return PyLong_FromLong(code);
}

static PyMethodDef methods[] = {
    {"sort_pairs", (PyCFunction)(void (*)(void))sort_pairs, METH_FASTCALL,
     "sort_pairs(s, d, num_src, num_dst, s_out, d_out) -> 0, 1, 2 or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_runs", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_runs(void) { return PyModule_Create(&module); }
"""


@functools.cache
def sort_pairs() -> Any:
    """The C ``sort_pairs`` (module docstring), built once; None where it cannot be."""
    module = build(_SOURCE, "kvmgr_runs")
    return None if module is None else module.sort_pairs
