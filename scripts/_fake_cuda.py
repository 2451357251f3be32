"""CUDA stand-ins for the host-cost scripts that run the CUDA engines on CPU
(``scripts/submit_cost.py``, ``scripts/step_engine_ab.py``).

``install()`` replaces ``torch.cuda``'s streams and events with objects that do nothing, makes
host registration a no-op, gives the copy kernel plain CPU tensors for its table slots and stubs
its two launches (they return the number of programs they would have launched). Everything else
the engines run is the real code. It imports kvmgr only when called, so the tree on
``PYTHONPATH`` decides which kvmgr it patches (an A/B run over two trees).

``install_host_funcs(package, delay_s)`` (for ``completion="host_func"``, helper stepcuda7): a
stand-in ``cuLaunchHostFunc`` in C. The launch puts the host function in a ring (a mutex, no
signal: no thread is woken); a "device" thread of its own, no Python, looks every 200 us and
calls each host function ``delay_s`` after its launch, as a copy stream would once the batch
ended. So the completion thread is woken off the step, as on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any

import torch


class Stream:
    """``torch.cuda.Stream`` stand-in: a fixed handle, every operation a no-op."""

    cuda_stream = 0x1234
    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Event:
    """``torch.cuda.Event`` stand-in: always complete, 0 ms elapsed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def install() -> None:
    """Patch ``torch.cuda``, host registration and the copy kernel's table slots and launches
    for the rest of the process (these scripts run nothing else)."""
    from kvmgr.kernels.copy import staging
    from kvmgr.transfer import pinned

    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.Stream = Stream  # type: ignore[assignment,misc]
    torch.cuda.Event = Event  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: Stream()  # type: ignore[assignment]
    torch.cuda.device = lambda device: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    pinned.torch_registrar = lambda: pinned.HostRegistrar(lambda a, n: None, lambda a: None)

    def slot(capacity: int, device: Any) -> Any:
        host, table = (torch.zeros(3 * capacity, dtype=torch.int64) for _ in range(2))
        return staging.TableSlot(capacity, host, host.numpy(), table, host.data_ptr(),
                                 table.data_ptr())  # fmt: skip

    staging.new_table_slot = slot  # type: ignore[assignment]
    staging.launch_copy_table = lambda table, n, programs, **kw: min(n, programs)  # type: ignore[assignment]
    staging.launch_block_table = lambda layout, runs, t, n, programs, **kw: min(t * n, programs)  # type: ignore[assignment]


_DEVICE_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

typedef void (*host_fn)(void *);
#define RING 65536
static struct { host_fn fn; void *data; double due; } ring[RING];
static long head = 0, tail = 0;
static double delay_s = 0.001;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *device(void *unused) {
    for (;;) {
        struct timespec pause = {0, 200000};
        nanosleep(&pause, NULL);
        pthread_mutex_lock(&mu);
        while (tail < head && ring[tail % RING].due <= now()) {
            host_fn fn = ring[tail % RING].fn;
            void *data = ring[tail % RING].data;
            tail++;
            pthread_mutex_unlock(&mu);
            fn(data);
            pthread_mutex_lock(&mu);
        }
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

/* cuLaunchHostFunc(stream, fn, data) */
static int launch(uint64_t stream, uint64_t fn, uint64_t data) {
    pthread_mutex_lock(&mu);
    int full = head - tail >= RING;
    if (!full) {
        ring[head % RING].fn = (host_fn)(uintptr_t)fn;
        ring[head % RING].data = (void *)(uintptr_t)data;
        ring[head % RING].due = now() + delay_s;
        head++;
    }
    pthread_mutex_unlock(&mu);
    return full ? 2 : 0;
}

static PyObject *start(PyObject *self, PyObject *arg) {
    static int started = 0;
    delay_s = PyFloat_AsDouble(arg);
    if (!started) {
        pthread_t thread;
        pthread_create(&thread, NULL, device, NULL);
        pthread_detach(thread);
        started = 1;
    }
    return PyLong_FromVoidPtr((void *)&launch);
}

static PyMethodDef methods[] = {{"start", start, METH_O, "start(delay_s) -> launch address"},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_fake_device", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kvmgr_fake_device(void) { return PyModule_Create(&module); }
"""


def install_host_funcs(package: str, delay_s: float = 0.001) -> None:
    """Make ``package``'s ``cuLaunchHostFunc`` the C stand-in above (module docstring)."""
    native = importlib.import_module(package + "._native")
    wake = importlib.import_module(package + ".transfer._host_wake")
    call = importlib.import_module(package + ".transfer.driver_call").native_call()
    device = native.build(_DEVICE_SOURCE, "kvmgr_fake_device")
    if device is None or call is None:
        raise RuntimeError("the fake device's C module or the C call module does not build")
    wake.host_func_launcher = lambda: functools.partial(call, device.start(delay_s))
