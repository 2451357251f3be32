"""The moved-tensor check's fast path in one C call over torch's stable C ABI (private to
:mod:`kvmgr.worker`; issue 27).

Offers:
    same_check      ``same_check(tensors)``: a callable ``() -> bool``, True while every tensor
                    has the TensorImpl, data pointer, sizes, strides, dtype and device it has
                    now; None where it cannot be built (then the caller keeps torch's guard)

Why: torch's C++ tensor guard (``torch._C._dynamo.guards.TensorGuards``) plus the pointers cost
13-16 us of a cold step for 48 KV tensors on the 2-core VM (21 us on the H200 host). This module
reads each tensor's metadata through AOTInductor's C shim (``aoti_torch_get_data_ptr``,
``_get_dim``, ``_get_sizes``, ``_get_strides``, ``_get_dtype``, ``_get_device_type``,
``_get_device_index`` in ``libtorch_cpu``: torch's stable C ABI for compiled models; each
returns an error code rather than throwing) and compares it with a snapshot taken at build time,
without a Python call: 0.75 us for 48 tensors hot (H200 host; 1.3 us on the 2-core VM, the
same with the impl word as without). Cold, as a step finds them after the calls, each tensor's
reads (its Python object, handle, ``TensorImpl``, ``StorageImpl``) are a chain of dependent
cache misses, so ``same`` first prefetches all of them for every tensor (the ``StorageImpl``
addresses sit at the end of the snapshot): 9.1 -> 3.9 us median for 48 tensors after a 16 MiB
write on the VM (BENCHMARKS.md, round 4 session 14).

The shim reads through an ``AtenTensorHandle`` (an ``at::Tensor`` on the heap sharing the
tensor's ``TensorImpl``: ``torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors``), freed when the
check is dropped. Every public way a tensor moves (``resize_``, ``set_``, ``as_strided_``,
``.data =``, an in-place view op) changes that ``TensorImpl`` itself, which the handle sees.
The private ``torch._C._swap_tensor_impl`` instead gives the Python object another
``TensorImpl``: the check also compares the word of each Python object that holds its
``TensorImpl`` pointer (found at build by looking for ``tensor._cdata``; no such word, no check)
with the one snapshotted. (``torch.utils.swap_tensors`` refuses a guarded tensor outright: the
handle is a second reference to its ``TensorImpl``.) The snapshot is
read through the shim and must equal ``data_ptr()``, ``shape`` and ``stride()`` as Python reads
them, else no check is built. A shim call that fails (a tensor without storage) makes the check
say False: the caller's exact compare decides. Where anything is missing (no Triton or compiler,
``KVMGR_NATIVE_LAUNCH=0``, a torch without the shim or ``torch._C._aoti``), ``same_check``
returns None.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvmgr._native import build

__all__ = ["same_check"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int32_t (*get_p_t)(void *, int64_t **);
typedef int32_t (*get_l_t)(void *, int64_t *);
typedef int32_t (*get_i_t)(void *, int32_t *);
typedef int32_t (*get_v_t)(void *, void **);
static get_p_t get_sizes = NULL, get_strides = NULL;
static get_l_t get_dim = NULL;
static get_i_t get_dtype = NULL, get_devtype = NULL, get_devidx = NULL;
static get_v_t get_ptr = NULL;

/* use(sizes, strides, dim, dtype, device_type, device_index, data_ptr): the shim's addresses */
static PyObject *use(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *a[7];
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "use(7 addresses)");
        return NULL;
    }
    for (int i = 0; i < 7; i++) {
        a[i] = PyLong_AsVoidPtr(args[i]);
        if (a[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "use: a NULL address");
            return NULL;
        }
    }
    get_sizes = (get_p_t)a[0]; get_strides = (get_p_t)a[1]; get_dim = (get_l_t)a[2];
    get_dtype = (get_i_t)a[3]; get_devtype = (get_i_t)a[4]; get_devidx = (get_i_t)a[5];
    get_ptr = (get_v_t)a[6];
    Py_RETURN_NONE;
}

/* one tensor's record: data_ptr, dtype, device type, device index, dim, sizes[dim], strides[dim]
   into out (room for 5 + 2 * max_dim); its length, or -1 where a shim call failed */
static int64_t read_one(void *h, int64_t *out, int64_t max_dim) {
    void *ptr; int32_t dt, dv, di; int64_t dim, *sz, *st;
    if (get_ptr(h, &ptr) || get_dtype(h, &dt) || get_devtype(h, &dv) || get_devidx(h, &di)
        || get_dim(h, &dim) || dim < 0 || dim > max_dim || get_sizes(h, &sz)
        || get_strides(h, &st)) return -1;
    out[0] = (int64_t)(uintptr_t)ptr; out[1] = dt; out[2] = dv; out[3] = di; out[4] = dim;
    for (int64_t k = 0; k < dim; k++) { out[5 + k] = sz[k]; out[5 + dim + k] = st[k]; }
    return 5 + 2 * dim;
}

/* read(handle): the record as a tuple of ints, or None where a shim call failed */
static PyObject *read_record(PyObject *self, PyObject *arg) {
    int64_t rec[5 + 2 * 64];
    void *h = PyLong_AsVoidPtr(arg);
    if (h == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "read: a NULL handle");
        return NULL;
    }
    if (get_ptr == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read: no shim (use first)");
        return NULL;
    }
    int64_t n = read_one(h, rec, 64);
    if (n < 0) Py_RETURN_NONE;
    PyObject *out = PyTuple_New((Py_ssize_t)n);
    if (out == NULL) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(rec[i]);
        if (v == NULL) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

/* same(spec): spec at an address, int64 {n, impl offset, then per tensor: the Python object's
   address, its TensorImpl, handle, record; then per tensor its StorageImpl as at build}: True
   where every Python object still holds its TensorImpl (the word at the offset;
   ``torch._C._swap_tensor_impl`` swaps it) and every handle's record equals its snapshot, False
   otherwise (or where a shim call failed). A first pass only prefetches what the compare reads
   (the object's word, the handle, the TensorImpl's first 256 bytes, the StorageImpl's first
   128): in a step these are cold, and the compare's reads of one tensor depend on each other,
   so without it the misses come one after another. A prefetch never faults and changes
   nothing (a StorageImpl since freed is only an address). */
static PyObject *same(PyObject *self, PyObject *arg) {
    const int64_t *spec = (const int64_t *)PyLong_AsVoidPtr(arg);
    int64_t rec[5 + 2 * 64];
    if (spec == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "same: a NULL spec");
        return NULL;
    }
    if (get_ptr == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "same: no shim (use first)");
        return NULL;
    }
    const int64_t off = spec[1];
    const int64_t *p = spec + 2;
    for (int64_t i = 0; i < spec[0]; i++) {
        const char *impl = (const char *)(uintptr_t)p[1];
        __builtin_prefetch((const char *)(uintptr_t)p[0] + off);
        __builtin_prefetch((const void *)(uintptr_t)p[2]);
        for (int k = 0; k < 256; k += 64) __builtin_prefetch(impl + k);
        p += 8 + 2 * p[7];
    }
    for (int64_t i = 0; i < spec[0]; i++) {
        const char *storage = (const char *)(uintptr_t)p[i];
        __builtin_prefetch(storage);
        __builtin_prefetch(storage + 64);
    }
    p = spec + 2;
    for (int64_t i = 0; i < spec[0]; i++) {
        if (*(const int64_t *)((const char *)(uintptr_t)p[0] + off) != p[1]) Py_RETURN_FALSE;
        int64_t n = read_one((void *)(uintptr_t)p[2], rec, 64);
        if (n != 5 + 2 * p[7]) Py_RETURN_FALSE;
        for (int64_t k = 0; k < n; k++) if (rec[k] != p[3 + k]) Py_RETURN_FALSE;
        p += 3 + n;
    }
    Py_RETURN_TRUE;
}

/* address(capsule or int): the pointer a handle capsule holds */
static PyObject *address(PyObject *self, PyObject *arg) {
    if (PyCapsule_CheckExact(arg)) {
        void *p = PyCapsule_GetPointer(arg, PyCapsule_GetName(arg));
        return p == NULL ? NULL : PyLong_FromVoidPtr(p);
    }
    void *p = PyLong_AsVoidPtr(arg);
    if (p == NULL && PyErr_Occurred()) return NULL;
    return PyLong_FromVoidPtr(p);
}

static PyMethodDef methods[] = {
    {"use", (PyCFunction)(void (*)(void))use, METH_FASTCALL, "use(7 shim addresses)"},
    {"read", read_record, METH_O, "read(handle) -> the tensor's record, or None"},
    {"same", same, METH_O, "same(spec address) -> whether every tensor is as in the spec"},
    {"address", address, METH_O, "address(handle capsule) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_guard", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_guard(void) { return PyModule_Create(&module); }
"""

_SHIM = ("sizes", "strides", "dim", "dtype", "device_type", "device_index", "data_ptr")
_MAX_DIM = 64


@functools.cache
def _module() -> Any:
    """The C module with the shim's entry points set, or None where either is missing."""
    aoti = getattr(torch._C, "_aoti", None)
    if aoti is None or not hasattr(aoti, "unsafe_alloc_void_ptrs_from_tensors"):
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        entries = [ctypes.cast(getattr(lib, f"aoti_torch_get_{n}"), ctypes.c_void_p).value
                   for n in _SHIM]  # fmt: skip
    except (OSError, AttributeError):  # another platform's library name, an older torch
        return None
    module = build(_SOURCE, "kvmgr_guard")
    if module is None or not all(entries):
        return None
    module.use(*entries)
    return module


class _Snapshot:
    """The spec array, the tensors it names and the handles it reads through (freed with it)."""

    def __init__(self, module: Any, tensors: Sequence[torch.Tensor]) -> None:
        aoti = torch._C._aoti
        self.tensors = list(tensors)  # the Python objects the spec names by address live on
        handles = aoti.unsafe_alloc_void_ptrs_from_tensors(self.tensors)
        weakref.finalize(self, aoti.alloc_tensors_by_stealing_from_void_ptrs, handles)
        offset = _impl_offset(self.tensors)
        self.valid = offset is not None
        if offset is None:
            return
        words: list[int] = [len(tensors), offset]
        for tensor, handle in zip(tensors, handles):
            address = module.address(handle)
            record = module.read(address)
            if record is None or not _agrees(record, tensor):
                self.valid = False
                return
            words.extend((id(tensor), tensor._cdata, address))
            words.extend(record)
        words.extend(t.untyped_storage()._cdata for t in tensors)  # (prefetched only)
        self.spec = np.array(words, dtype=np.int64)
        self.address = int(self.spec.ctypes.data)


def _impl_offset(tensors: Sequence[torch.Tensor]) -> int | None:
    """Where each tensor's Python object keeps its ``TensorImpl`` pointer (``THPVariable.cdata``:
    16 bytes in on torch 2.13), found by reading the object's words for ``tensor._cdata``; the
    one offset that holds it in every tensor, or None (another layout, a borrowed tensor)."""
    size = min(type(t).__basicsize__ for t in tensors)
    for offset in range(16, size - 7, 8):
        if all(ctypes.c_int64.from_address(id(t) + offset).value == t._cdata for t in tensors):
            return offset
    return None


def _agrees(record: tuple[int, ...], tensor: torch.Tensor) -> bool:
    """Whether a shim record says what Python reads: pointer, shape, strides."""
    dim = record[4]
    return (
        record[0] == tensor.data_ptr()
        and dim == tensor.dim() <= _MAX_DIM
        and record[5 : 5 + dim] == tuple(tensor.shape)
        and record[5 + dim :] == tensor.stride()
    )


def same_check(tensors: Sequence[torch.Tensor]) -> Callable[[], bool] | None:
    """``f() -> bool``: True while every tensor's data pointer, sizes, strides, dtype and device
    are what they are now (one C call; module docstring); None where the shim or kvmgr's C
    modules are missing, a tensor is not a ``torch.Tensor``, or the shim disagrees with Python
    about one of them. ``f`` keeps the tensors (objects and ``TensorImpl``s) alive, as the caller
    does."""
    module = _module()
    if module is None or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    try:
        snapshot = _Snapshot(module, tensors)
    except Exception:  # a tensor the shim cannot hold
        return None
    if not snapshot.valid:
        return None
    check = functools.partial(module.same, snapshot.address)
    check.snapshot = snapshot  # type: ignore[attr-defined]  # (the spec and handles live on)
    return check
