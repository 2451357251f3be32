"""A batched store's per-key passes in single C calls (private to kvmgr._keys, kvmgr.scheduler).

Offers ``index_c``: the compiled module, or None where kvmgr's C modules do not build (no
Triton, no compiler, ``KVMGR_NATIVE_LAUNCH=0``; callers then take their Python paths, which
compute the same). Each function is one C loop where Python made a call per key or id.

``bytes_list(keys)``: a new list of the items of ``keys`` (an exact ``list`` or ``tuple``) when
every one is exactly ``bytes`` and non-empty; else None (the Python path words the error).

``add_absent(index, keys, values)``: ``index`` an exact ``dict``, ``keys`` an exact ``list``
of exact ``bytes``, ``values`` a ``list`` of ``len(keys)`` items or one object for every key.
Inserts ``keys[i] -> values[i]`` in order and stops at the first key that is not new (indexed
already, repeated in ``keys``, or not exactly ``bytes``): returns how many were inserted (the
index's last entries, in order; the caller takes them back). An exception (memory) takes back
what was inserted before it propagates. Before each chunk of 64 keys it prefetches the index
slots (up to 8 probes a key) and entries the insertions will read: two dependent cache misses a
probe in an index of up to millions of keys (all probes 0.40-0.61x of the first one alone;
BENCHMARKS.md, round 4 session 15). It reads CPython's dict layout (3.11-3.13, not
free-threaded; none elsewhere) and changes no result.

``increasing_ok(ids, state, held, num_blocks)``: ``ids`` a 1-D C-contiguous int64 buffer,
``state`` a uint8 buffer (or None): True when ``ids`` are strictly increasing, inside
``[0, num_blocks)`` and (``state`` given) ``state[id] == held`` for each; False otherwise or for
buffers of other kinds (the caller's numpy path decides and words the error).

``set_items(index, keys, values)``: ``index.update(zip(keys, values))`` (lists of one length),
or with ``values`` None ``del index[key]`` for each key in order (a missing key: ``KeyError``,
the keys before it deleted, as the Python loops).

``put_objects(array, at, items)``: ``array[at] = items`` for a numpy object array (``at`` an
int: the run from it, or int64 positions); False, nothing written, for others or outside it.

``tests/scheduler/test_index_c.py`` runs each against its Python path. ``Stores`` builds the
module when it is made (:func:`index_c`), not at a first store.
"""

from __future__ import annotations

from typing import Any

from kvmgr._ids_c import built_once

__all__ = ["index_c"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *bytes_list(PyObject *self, PyObject *keys) {
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) == 0) Py_RETURN_NONE;
    }
    return PyList_CheckExact(keys) ? PyList_GetSlice(keys, 0, n) : PySequence_List(keys);
}

/* take back the last n entries of index (inserted last), keeping the pending exception */
static void take_back(PyObject *index, Py_ssize_t n) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyObject_CallMethod(index, "popitem", NULL);
        if (item == NULL) {
            PyErr_Clear();
            break;
        }
        Py_DECREF(item);
    }
    PyErr_Restore(type, value, trace);
}

/* The index's hash table, read only to prefetch (a hint: a prefetch never faults and changes
   no result): CPython 3.11-3.13's layout of a dict and its keys object (Objects/dictobject.c,
   Include/internal/pycore_dict.h), which kvmgr cannot include; elsewhere no prefetch. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define PREFETCH 1
typedef struct {
    Py_ssize_t refcnt;
    uint8_t log2_size, log2_index_bytes, kind;
    uint32_t version;
    Py_ssize_t usable, nentries;
    char indices[];
} table_t;
typedef struct {
    PyObject_HEAD
    Py_ssize_t used;
    uint64_t version_tag;
    table_t *table;
    void *values;
} dict_t;
#else
#define PREFETCH 0
#endif

/* The probes of each key's insertion (keys[lo:hi], exact bytes: their cached hashes), ahead
   of it: each pass reads the slots the one before prefetched, prefetches the entry a taken
   slot names and the slot the probe goes on to (CPython's i = (5 * i + perturb + 1) & mask,
   perturb >>= 5), up to PROBES a key. Nothing here changes a result. */
#define CHUNK 64
#define PROBES 8
static void prefetch(PyObject *index, PyObject *keys, Py_ssize_t lo, Py_ssize_t hi) {
#if PREFETCH
    table_t *t = ((dict_t *)index)->table;
    int shift = t->log2_index_bytes - t->log2_size;
    if (shift < 0 || shift > 3 || hi - lo > CHUNK) return;
    size_t mask = ((size_t)1 << t->log2_size) - 1;
    const char *entries = t->indices + ((size_t)1 << t->log2_index_bytes);
    size_t entry = t->kind == 0 ? 3 * sizeof(void *) : 2 * sizeof(void *);
    size_t slot[CHUNK], perturb[CHUNK];
    Py_ssize_t m = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key)) continue;
        size_t hash = (size_t)PyObject_Hash(key);
        slot[m] = hash & mask;
        perturb[m] = hash;
        __builtin_prefetch(t->indices + (slot[m] << shift));
        m++;
    }
    for (int probe = 1; probe <= PROBES && m > 0; probe++) {
        Py_ssize_t still = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            size_t s = slot[j];
            int64_t ix;
            switch (shift) {
            case 0: ix = ((int8_t *)t->indices)[s]; break;  case 1: ix = ((int16_t *)t->indices)[s]; break;
            case 2: ix = ((int32_t *)t->indices)[s]; break; default: ix = ((int64_t *)t->indices)[s];
            }
            if (ix >= 0) __builtin_prefetch(entries + entry * (size_t)ix);
            if (ix == -1 || probe == PROBES) continue; /* an empty slot: the probe ends there */
            size_t p = perturb[j] >> 5;
            slot[still] = mask & (s * 5 + p + 1);
            perturb[still] = p;
            __builtin_prefetch(t->indices + (slot[still] << shift));
            still++;
        }
        m = still;
    }
#endif
}

static PyObject *add_absent(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "add_absent(dict, list, values)");
        return NULL;
    }
    PyObject *index = args[0], *keys = args[1], *values = args[2];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    int each = PyList_CheckExact(values);
    if (each && PyList_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "add_absent: one value per key");
        return NULL;
    }
    Py_ssize_t added = 0;
    for (; added < n; added++) {
        PyObject *key = PyList_GET_ITEM(keys, added);
        if (!PyBytes_CheckExact(key)) break;
        if (added % CHUNK == 0) prefetch(index, keys, added, added + CHUNK < n ? added + CHUNK : n);
        Py_ssize_t before = PyDict_GET_SIZE(index);
        PyObject *value = each ? PyList_GET_ITEM(values, added) : values;
        if (PyDict_SetDefault(index, key, value) == NULL) {
            take_back(index, added + (PyDict_GET_SIZE(index) > before));
            return NULL;
        }
        if (PyDict_GET_SIZE(index) == before) break; /* present: nothing inserted */
    }
    return PyLong_FromSsize_t(added);
}

static int int64_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
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

static PyObject *increasing_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "increasing_ok(ids, state, held, num_blocks)");
        return NULL;
    }
    long long held = PyLong_AsLongLong(args[2]), num = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer ids, state;
    if (!int64_buffer(args[0], &ids, 8)) Py_RETURN_FALSE;
    int with_state = args[1] != Py_None;
    if (with_state && !int64_buffer(args[1], &state, 1)) {
        PyBuffer_Release(&ids);
        Py_RETURN_FALSE;
    }
    const int64_t *id = (const int64_t *)ids.buf;
    Py_ssize_t n = ids.shape[0];
    int ok = with_state ? state.shape[0] >= num : 1;
    int64_t last = -1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int64_t b = id[i];
        ok = b > last && b < num;
        if (ok && with_state) ok = ((const uint8_t *)state.buf)[b] == held;
        last = b;
    }
    PyBuffer_Release(&ids);
    if (with_state) PyBuffer_Release(&state);
    return PyBool_FromLong(ok);
}

/* array[at[i]] = items[i] (at: an int64 buffer of len(items) positions, or an int: a run from
   it), array a 1-D C-contiguous buffer of objects (a numpy object array): True; False, nothing
   written, for other buffers or a position outside the array */
static PyObject *put_objects(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "put_objects(array, at, list)");
        return NULL;
    }
    PyObject *items = args[2];
    Py_ssize_t n = PyList_GET_SIZE(items), start = -1;
    Py_buffer dst, at;
    int run = PyLong_CheckExact(args[1]);
    if (run) {
        start = PyLong_AsSsize_t(args[1]);
        if (start == -1 && PyErr_Occurred()) return NULL;
    } else if (!int64_buffer(args[1], &at, 8)) {
        Py_RETURN_FALSE;
    }
    int held = PyObject_GetBuffer(args[0], &dst, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0;
    if (!held) PyErr_Clear();
    int ok = held && dst.ndim == 1 && dst.itemsize == sizeof(PyObject *) && dst.format != NULL &&
             !strcmp(dst.format, "O");
    Py_ssize_t size = ok ? dst.shape[0] : 0;
    const int64_t *pos = run ? NULL : (const int64_t *)at.buf;
    if (ok) ok = run ? start >= 0 && start <= size - n : at.shape[0] == n;
    for (Py_ssize_t i = 0; ok && pos != NULL && i < n; i++) ok = pos[i] >= 0 && pos[i] < size;
    if (ok) {
        PyObject **cells = (PyObject **)dst.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(items, i), **cell = cells + (run ? start + i : pos[i]);
            PyObject *old = *cell;
            Py_INCREF(item);
            *cell = item;
            Py_XDECREF(old);
        }
    }
    if (held) PyBuffer_Release(&dst);
    if (!run) PyBuffer_Release(&at);
    return PyBool_FromLong(ok);
}

/* index[keys[i]] = values[i] in order (keys, values: lists of one length), or (values None)
   del index[keys[i]]: as dict.update(zip(keys, values)) / one del per key, stopping at the
   first error (a missing key: KeyError) with what came before it done */
static PyObject *set_items(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        (args[2] != Py_None && (!PyList_CheckExact(args[2]) || PyList_GET_SIZE(args[2]) != PyList_GET_SIZE(args[1])))) {
        PyErr_SetString(PyExc_TypeError, "set_items(dict, list, list of one length or None)");
        return NULL;
    }
    PyObject *index = args[0], *keys = args[1], *values = args[2];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        int rc = values == Py_None ? PyDict_DelItem(index, key)
                                   : PyDict_SetItem(index, key, PyList_GET_ITEM(values, i));
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bytes_list", bytes_list, METH_O, "bytes_list(keys) -> a new list, or None"},
    {"add_absent", (PyCFunction)(void (*)(void))add_absent, METH_FASTCALL, "add_absent(index, keys, values) -> the number inserted"},
    {"increasing_ok", (PyCFunction)(void (*)(void))increasing_ok, METH_FASTCALL, "increasing_ok(ids, state, held, num_blocks) -> bool"},
    {"set_items", (PyCFunction)(void (*)(void))set_items, METH_FASTCALL, "set_items(index, keys, values or None)"},
    {"put_objects", (PyCFunction)(void (*)(void))put_objects, METH_FASTCALL, "put_objects(array, at, list) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_index", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_index(void) { return PyModule_Create(&module); }
"""


_built: list[Any] = []  #: the module (or None) once built or found missing


def index_c() -> Any:
    """The module (module docstring), built once; None where it cannot be built, and
    (without building) while torch is not loaded (the builder, :mod:`kvmgr._native`, imports
    torch, which the scheduler side never imports itself)."""
    return built_once(_built, _SOURCE, "kvmgr_index")
