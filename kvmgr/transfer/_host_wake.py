"""Completion woken by the copy stream itself, not by the submitting thread (opt-in; private to
:mod:`kvmgr.transfer.streams`; issue 27).

Offers:
    HostFuncInbox       one direction's completion inbox: ``put(item)`` appends the batch to a
                        deque and enqueues a host function on its copy stream
                        (``cuLaunchHostFunc``) whose C callback writes an eventfd; ``run`` is
                        the completion thread, asleep in ``poll`` on that eventfd
    host_func_launcher  ``launch(stream, callback, data) -> CUresult`` through the driver from
                        C, or None where it (or the C callback, or ``os.eventfd``) is missing
    host_func_inboxes   the inboxes of both directions where ``completion`` asks for them
    COMPLETIONS         the ``completion`` choices: ``"queue"`` (default), ``"host_func"``

Why: with ``completion="queue"`` a submit hands its batch to the direction's completion thread
by a ``queue.SimpleQueue.put`` that wakes that sleeping thread at once (a futex wake on the
submitting thread), and the woken thread then takes the GIL from the loop thread for a few
bytecodes before it sleeps again in the end event's ``synchronize``: 6-27 us of a cold step on
the 2-core VM, 12-27 us on the H200 host (BENCHMARKS.md, round 4 sessions 9-10). With
``"host_func"`` the submit appends to a deque (no wake) and makes one driver call; the thread
is woken when the copy stream reaches the host function, i.e. when the batch has ended on the
device (milliseconds later, off the step), by the driver's own callback thread: a C function
(``wake``, below) that writes the eventfd and touches no Python object (no GIL).

Cost on the device: the copy stream runs nothing after a host function until the driver's thread
has called it, so a batch queued right behind another on its stream starts that much later (the
callback thread's wake-up, some microseconds), and that delay counts in its ``device_s`` where
it is timed from the previous batch's end. Unmeasured here (no GPU): ``scripts/gpu/stepcuda7.sh``
measures the host side; hence opt-in.

Soundness (docs/transfer.md, rule 7): the thread still settles every batch through
``CopyStreams._complete``, i.e. after its end event's ``synchronize``: the wake only says when
to look. A credit (one eventfd count) completes the oldest pending batch (a host function runs
after its batch's end event on the FIFO stream); batches whose end event ``query()`` says done
(or raises) are completed too, and the thread looks again every ``_POLL_MS`` (20 ms) while
batches are pending and every ``_IDLE_MS`` (1 s) while none is (a batch may come in while it
sleeps), because the driver runs no host function after a device error: the error then
surfaces at ``synchronize`` as with ``"queue"``, within about a second at worst. A host function that could not be enqueued
gets its credit from the submitting thread. A host function writes through a small C target
(the eventfd under a mutex); at stop the thread closes the eventfd through it, so a host function
that runs later (after a device error, or once its batch's end event was seen done) writes
nothing, never to a reused descriptor number. The target itself (56 bytes) is never freed.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import select
from collections.abc import Callable
from typing import Any

from kvmgr._native import build
from kvmgr.errors import ConfigError
from kvmgr.transfer.driver_call import native_call

__all__ = [
    "COMPLETIONS",
    "HostFuncInbox",
    "host_func_inboxes",
    "host_func_launcher",
    "wake_address",
]

_LOG = logging.getLogger(__name__)

COMPLETIONS = ("queue", "host_func")
_POLL_MS = 20  # while batches are pending: how often the thread looks without a wake
_IDLE_MS = 1000  # with none pending (one may come in while it sleeps): how often it looks

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

/* what a host function writes to: an eventfd, -1 once released (never freed: a host function
   may still run after its inbox stopped, and must find the -1, not freed memory) */
typedef struct { pthread_mutex_t mu; int fd; } target_t;

/* the host function: one eventfd count, no Python, no CUDA call (cuLaunchHostFunc's rule) */
static void wake(void *data) {
    target_t *t = (target_t *)data;
    uint64_t one = 1;
    pthread_mutex_lock(&t->mu);
    if (t->fd >= 0) {
        ssize_t written = write(t->fd, &one, sizeof one);
        (void)written;
    }
    pthread_mutex_unlock(&t->mu);
}

static PyObject *wake_address(PyObject *self, PyObject *unused) {
    return PyLong_FromVoidPtr((void *)&wake);
}

/* target(fd): a new target for wake, its address */
static PyObject *target(PyObject *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    target_t *t = (target_t *)malloc(sizeof(target_t));
    if (t == NULL) return PyErr_NoMemory();
    pthread_mutex_init(&t->mu, NULL);
    t->fd = (int)fd;
    return PyLong_FromVoidPtr(t);
}

/* release(address): close the target's eventfd; a later wake writes nothing */
static PyObject *release(PyObject *self, PyObject *arg) {
    target_t *t = (target_t *)PyLong_AsVoidPtr(arg);
    if (t == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "release: a NULL target");
        return NULL;
    }
    pthread_mutex_lock(&t->mu);
    if (t->fd >= 0) close(t->fd);
    t->fd = -1;
    pthread_mutex_unlock(&t->mu);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"wake_address", wake_address, METH_NOARGS, "the address of the C host function"},
    {"target", target, METH_O, "target(fd) -> the address of a new target for the host function"},
    {"release", release, METH_O, "release(target): close its fd; later host functions write nothing"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmgr_host_wake", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmgr_host_wake(void) { return PyModule_Create(&module); }
"""


@functools.cache
def _module() -> Any:
    """The C module (``wake``, ``target``, ``release``), or None where it or ``os.eventfd``
    is missing."""
    return build(_SOURCE, "kvmgr_host_wake") if hasattr(os, "eventfd") else None


def wake_address() -> int | None:
    """The address of the C host function ``wake(target)``, or None where it does not build."""
    module = _module()
    return None if module is None else int(module.wake_address())


def host_func_launcher() -> Callable[[int, int, int], int] | None:
    """``launch(stream handle, callback address, data) -> CUresult``: the driver's
    ``cuLaunchHostFunc`` called from C (the GIL released), or None where the driver, the C
    call module, the C callback or ``os.eventfd`` is missing."""
    call = native_call()
    if call is None or wake_address() is None:
        return None
    try:
        from kvmgr.transfer.driver_abi import cuda_python_resolver

        entry = cuda_python_resolver("cuLaunchHostFunc", 10000)
    except Exception:  # no cuda-python, no driver
        return None
    return None if not entry else functools.partial(call, int(entry))


def host_func_inboxes(completion: str | None, streams: dict[Any, Any]) -> dict[Any, HostFuncInbox] | None:  # fmt: skip
    """One ``HostFuncInbox`` per direction of ``streams`` (direction -> copy stream) where
    ``completion`` (None: ``KVMGR_COMPLETION`` in the environment, else ``"queue"``) is
    ``"host_func"`` and the launcher builds; None for ``"queue"`` or, logged, where it does not.

    Raises:
        ConfigError: ``completion`` is none of ``COMPLETIONS``.
    """
    if completion is None:
        completion = os.environ.get("KVMGR_COMPLETION", "queue")
    if completion not in COMPLETIONS:
        raise ConfigError(f"expected completion in {list(COMPLETIONS)}, got {completion!r}")
    if completion == "queue":
        return None
    launch, callback = host_func_launcher(), wake_address()
    if launch is None or callback is None:
        _LOG.warning("completion='host_func' unavailable here (driver, C modules or eventfd "
                     "missing): completion='queue'")  # fmt: skip
        return None
    return {d: HostFuncInbox(stream.cuda_stream, launch, callback) for d, stream in streams.items()}


class HostFuncInbox:
    """One direction's completion inbox woken by host functions on its copy stream.

    Args:
        stream_handle: the copy stream's ``cuda_stream``.
        launch: ``host_func_launcher()``'s (or a test's) ``launch(stream, callback, data)``.
        callback: the address of the host function (``wake_address()``); its data is a C
            target holding the eventfd (``kvmgr_host_wake.target``).
    """

    def __init__(self, stream_handle: int, launch: Callable[[int, int, int], int], callback: int) -> None:  # fmt: skip
        self._stream, self._launch, self._callback = stream_handle, launch, callback
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._target = _module().target(self._fd)  # what the host functions write to
        self._pending: collections.deque[Any] = collections.deque()
        self.expected = 0  # eventfd writes to come: host functions enqueued, and our own
        self.credited = 0  # eventfd counts read
        self.polls = 0  # wakes without a credit (timeouts)
        self.skipped = 0  # batches put with a host function of an earlier one in flight

    def put(self, item: Any) -> None:
        """Hand ``item`` (a batch, or None: stop after the batches before it) to completion,
        without waking the thread. A host function is enqueued for it only where none is in
        flight (``expected == credited``): else the one in flight wakes the thread, which then
        settles every pending batch in order, one without a host function by waiting in its
        ``synchronize``. (Appended first, counted after: the thread either sees this batch
        before it sleeps, or had read every credit, and then this batch gets its own.)"""
        entry = [item, False]  # (the batch, whether a host function or write follows it)
        self._pending.append(entry)
        if item is not None and self.expected != self.credited:
            self.skipped += 1
            return
        entry[1] = True
        self.expected += 1
        try:
            code = 1 if item is None else self._launch(self._stream, self._callback, self._target)
        except Exception:  # (nothing enqueued either)
            code = 1
        if code != 0:
            os.eventfd_write(self._fd, 1)  # stop, or nothing was enqueued: the credit is ours

    def run(self, complete: Callable[[Any, Any], Any], after: Callable[[], None]) -> None:
        """The completion thread: ``previous = complete(item, previous)`` for each batch in
        order once it has ended (``complete`` synchronizes on its end event, releases and
        resolves; it returns None after a device error), ``after()`` after each; returns at
        the stop item. It sleeps only with a batch at the head whose host function is still
        to come (or, once ``_POLL_MS`` or ``_IDLE_MS`` passed, to look again)."""
        pending, poller = self._pending, select.poll()
        poller.register(self._fd, select.POLLIN)
        previous: Any = None
        owed = 0  # batches with a host function completed by their query before its credit
        while True:
            poller.poll(_POLL_MS if pending else _IDLE_MS)  # the GIL released
            got = self._drain()
            self.polls += not got
            forced, owed = max(0, got - owed), max(0, owed - got)
            while pending and pending[0][0] is not None:
                item, launched = pending[0]
                if not launched:
                    pass  # a host function of an earlier batch woke the thread: synchronize
                elif forced:
                    forced -= 1
                elif _ended(item):
                    owed += 1
                else:
                    break
                pending.popleft()
                previous = complete(item, previous)
                after()
            if pending and pending[0][0] is None:
                break
        _module().release(self._target)  # closes the eventfd: later host functions write nothing

    def _drain(self) -> int:
        try:
            got = os.eventfd_read(self._fd)
        except BlockingIOError:
            return 0
        self.credited += got
        return got


def _ended(item: Any) -> bool:
    """Whether a batch's end event says it ended (or raises: ``complete`` then reports it)."""
    try:
        return bool(item[0].end_event.query())
    except Exception:
        return True
