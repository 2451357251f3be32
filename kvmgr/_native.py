"""kvmgr's small C module (private): one home for it, so that the kernels and the worker use it
without depending on each other.

Offers:
    build               a C extension module compiled from its source (Triton's helper), or None
    c_module            the compiled module (``fire``, ``use_reader``, ``checked_ptrs``,
                        ``write_cells``), built once; None where it cannot be
    checked_data_ptrs   ``checked_data_ptrs()(check, *tensors)``: their ``data_ptr()``s where a
                        tensor guard's ``check`` accepts them, else None; one C call where it
                        builds (used by the worker's moved-tensor check,
                        :mod:`kvmgr.worker.tensors`, and the kernel families' steady paths)

The launch side of the module (``fire``: :mod:`kvmgr.kernels.launch.native`; ``write_cells``:
:func:`kvmgr.kernels.launch.cells.cell_writer`) is documented where it is used. The module is
compiled once per machine by Triton's own helper for its launchers
(``triton.runtime.build.compile_module_from_src``: the system C compiler, Triton's cache), the
first time it is asked for. Anything that fails there (no Triton, no compiler, another Triton)
leaves :func:`c_module` None and every caller on its Python path: the same results.

**Pointers.** ``checked_data_ptrs()`` returns ``f(check, *tensors)``: where ``check(*tensors)``
is True (a torch tensor guard's ``check``: :mod:`kvmgr._tensor_guard`) the ``data_ptr()``
of each tensor, else None, in ONE call: the module's ``checked_ptrs`` (``METH_FASTCALL``) calls
``check`` and then reads each pointer through torch's own C reader
(``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``, the one Inductor's
generated wrappers call): 0.5-0.6 us for a five-tensor guard's verdict plus the pointers, where
``Tensor.data_ptr()`` alone costs ~0.2 us per call on the 2-core CPU host (48 tensors: 1.5 us
against 3.3 us hot). The guard comes first by design: that reader throws a C++ exception for a
tensor without storage (a sparse one), which would end the process from C, and a guard built
from dense tensors refuses every such tensor (its dispatch keys). Anything that is not a
``torch.Tensor`` after an accepting check raises ``TypeError``. Where the module or the reader is
missing, or the reader disagrees with ``data_ptr()`` on probe tensors, ``f`` is the same in
Python.

``KVMGR_NATIVE_LAUNCH=0`` in the environment keeps everything on Python and ctypes (a way around
a platform where the module misbehaves, and the baseline of the A/B in
``scripts/gpu/launchhost.sh``). Imports torch only.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

try:  # torch's C reader of a tensor's data pointer lives with dynamo's guards
    from torch._C._dynamo import guards as _guards
except ImportError:  # pragma: no cover - a torch without dynamo
    _guards = None

__all__ = ["build", "c_module", "checked_data_ptrs"]

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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

typedef void *(*reader_t)(PyObject *);
static reader_t reader = NULL;
static PyObject *tensor_type = NULL;

/* use_reader(address, tensor type): checked_ptrs reads pointers with the C function at address */
static PyObject *use_reader(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "use_reader(address, tensor type)");
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(args[0]);
    if (address == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "use_reader: a NULL address");
        return NULL;
    }
    Py_INCREF(args[1]);
    Py_XDECREF(tensor_type);
    tensor_type = args[1];
    reader = (reader_t)address;
    Py_RETURN_NONE;
}

/* 1 where check(*tensors) is True and every tensor is a torch.Tensor, 0 where check refuses,
   -1 with an exception set (no reader, check raised, or not a tensor after an accepting check) */
static int accepted(const char *name, PyObject *check, PyObject *const *tensors, Py_ssize_t n) {
    if (reader == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s: no reader (use_reader first)", name);
        return -1;
    }
    PyObject *verdict = PyObject_Vectorcall(check, tensors, (size_t)n, NULL);
    if (verdict == NULL) return -1;
    int passed = verdict == Py_True;
    Py_DECREF(verdict);
    for (Py_ssize_t i = 0; passed && i < n; i++) {
        if (!PyObject_TypeCheck(tensors[i], (PyTypeObject *)tensor_type)) {
            PyErr_Format(PyExc_TypeError, "%s: tensor %zd is not a tensor", name, i);
            return -1;
        }
    }
    return passed;
}

/* the tuple of the n tensors' data pointers (each accepted by a guard: see checked_ptrs) */
static PyObject *pointers(PyObject *const *tensors, Py_ssize_t n) {
    PyObject *out = PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromVoidPtr(reader(tensors[i]));
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, value);
    }
    return out;
}

/* checked_ptrs(check, *tensors): the tuple of their data pointers where check(*tensors) is
   True (a torch tensor guard's check), else None: a pointer is read only from a tensor the guard
   accepted (torch's reader throws a C++ exception for a tensor without storage) */
static PyObject *checked_ptrs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "checked_ptrs(check, *tensors)");
        return NULL;
    }
    int passed = accepted("checked_ptrs", args[0], args + 1, nargs - 1);
    if (passed < 0) return NULL;
    if (!passed) Py_RETURN_NONE;
    return pointers(args + 1, nargs - 1);
}

/* write_cells(spec, check, known, *step): checked_ptrs of (*known, *step) (known: a tuple or
   list of tensors, e.g. a cache set's), then (spec: uint64 words at an address) {n_tensors,
   n_known, aligned, n_cells, n_words, known[n_known], cells[n_cells], (address, word)[n_words]}:
   the known tensors' pointers must equal known, the first two step tensors' bases (when n_cells
   >= 2) be 16-byte aligned both or not as aligned says; then each step tensor's pointer is
   written to its cell and each word to its address, and the tuple of those pointers returned.
   None (nothing written) for other numbers of tensors or any refusal */
static PyObject *write_cells(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3) {
        PyErr_SetString(PyExc_TypeError, "write_cells(spec, check, known, *step)");
        return NULL;
    }
    const unsigned long long *spec = (const unsigned long long *)PyLong_AsVoidPtr(args[0]);
    if (spec == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "write_cells: a NULL spec");
        return NULL;
    }
    if (!PyTuple_Check(args[2]) && !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "write_cells: known must be a tuple or list");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[2], "write_cells: known must be a tuple or list");
    if (seq == NULL) return NULL;
    Py_ssize_t n_known = PySequence_Fast_GET_SIZE(seq), n_cells = nargs - 3, n = n_known + n_cells;
    PyObject *all[64];
    if ((unsigned long long)n_known != spec[1] || (unsigned long long)n_cells != spec[3] || n > 64) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n_known; i++) all[i] = items[i];
    for (Py_ssize_t i = 0; i < n_cells; i++) all[n_known + i] = args[3 + i];
    PyObject *out = NULL;
    int passed = accepted("write_cells", args[1], all, n);
    if (passed <= 0) goto done;
    const unsigned long long *known = spec + 5, *cells = known + n_known, *words = cells + n_cells;
    PyObject *const *step = all + n_known;
    for (Py_ssize_t i = 0; i < n_known; i++) {
        if ((unsigned long long)(uintptr_t)reader(all[i]) != known[i]) goto done;
    }
    if (n_cells >= 2) {
        uintptr_t bases = (uintptr_t)reader(step[0]) | (uintptr_t)reader(step[1]);
        if (((bases & 15) == 0) != (spec[2] != 0)) goto done;
    }
    out = pointers(step, n_cells);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n_cells; i++)
        *(unsigned long long *)(uintptr_t)cells[i] = (uintptr_t)reader(step[i]);
    for (unsigned long long j = 0; j < spec[4]; j++)
        *(unsigned long long *)(uintptr_t)words[2 * j] = words[2 * j + 1];
done:
    Py_DECREF(seq);
    if (out == NULL && passed >= 0 && !PyErr_Occurred()) Py_RETURN_NONE;
    return out;
}

static PyMethodDef methods[] = {
    {"fire", fire, METH_O, "fire(record_address) -> the launch entry point's result"},
    {"use_reader", (PyCFunction)(void (*)(void))use_reader, METH_FASTCALL, "use_reader(address, tensor type)"},
    {"checked_ptrs", (PyCFunction)(void (*)(void))checked_ptrs, METH_FASTCALL, "checked_ptrs(check, *tensors) -> their data pointers, or None"},
    {"write_cells", (PyCFunction)(void (*)(void))write_cells, METH_FASTCALL, "write_cells(spec, check, known, *step) -> the written pointers, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_fire", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_fire(void) { return PyModule_Create(&module); }
"""


_data_ptr = torch.Tensor.data_ptr


def build(source: str, name: str) -> Any:
    """The C extension module ``name`` compiled from ``source`` by Triton's helper (cached per
    machine by Triton), or None where it cannot be built (no Triton, no C compiler, no Python
    headers) or ``KVMGR_NATIVE_LAUNCH=0`` is set. Callers cache the result."""
    if os.environ.get("KVMGR_NATIVE_LAUNCH", "1") == "0":
        return None
    try:
        from triton.runtime.build import compile_module_from_src

        return compile_module_from_src(source, name)
    except Exception:  # no C compiler, no Python headers, another Triton: the Python paths
        return None


@functools.cache
def c_module() -> Any:
    """The C module (module docstring), built once; None where it cannot be (or with
    ``KVMGR_NATIVE_LAUNCH=0``)."""
    return build(_SOURCE, "kvmgr_fire")


def _python_checked_ptrs(check: Callable[..., bool], *tensors: torch.Tensor) -> tuple[int, ...] | None:  # fmt: skip
    return tuple(map(_data_ptr, tensors)) if check(*tensors) is True else None


@functools.cache
def checked_data_ptrs() -> Callable[..., tuple[int, ...] | None]:
    """``f(check, *tensors)``: ``(t.data_ptr(), ...)`` where ``check(*tensors)`` is True (the
    ``check`` of a :func:`~kvmgr._tensor_guard.tensor_guard`), else None; from C where
    the module builds and agrees with ``data_ptr()`` on probes, else the same in Python (module
    docstring, **Pointers**)."""
    module = c_module()
    address = getattr(_guards, "_torchinductor_pyobject_tensor_data_ptr", None) if _guards else None  # fmt: skip
    if module is None or not isinstance(address, int) or not address:
        return _python_checked_ptrs
    try:
        module.use_reader(address, torch.Tensor)
        words = torch.empty(8, dtype=torch.int32)
        probes = (words, words[3:], words.view(torch.float16)[1:], torch.empty(0))
        agree = lambda *tensors: len(tensors) == 4  # noqa: E731
        if module.checked_ptrs(agree, *probes) == _python_checked_ptrs(agree, *probes):
            return module.checked_ptrs  # type: ignore[no-any-return]
    except Exception:  # another module or torch: the Python reads
        pass
    return _python_checked_ptrs
