"""The current CUDA device and stream, read cheaply on every submit (private to
``kvmgr.transfer``).

Offers:
    CurrentStream   the device's current stream as a ``torch.cuda.Stream``, rebuilt only when
                    the raw current-stream handle changes
    device_is_current   whether a device is the current one (torch's C reader)
    device_check    ``check() -> bool`` for one device: the driver's current context against the
                    device's primary one, one C call (``device_is_current`` where it cannot be)
    on_device       ``torch.cuda.device(device)`` unless it is already current
    real_cuda_events    whether ``torch.cuda.Event`` is torch's own class
    event_calls     ``(record, wait)`` of an event on a stream: the driver's entry points from
                    C (``DriverEvents``) or torch's C methods where they are torch's own
                    classes, else the objects' own methods
    DriverEvents    ``record`` / ``wait`` through ``cuEventRecord`` / ``cuStreamWaitEvent``
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from kvmgr.transfer.driver_abi import _error_name, cuda_python_resolver
from kvmgr.transfer.driver_call import native_call, native_context

__all__ = [
    "CurrentStream",
    "DriverEvents",
    "device_check",
    "device_is_current",
    "event_calls",
    "on_device",
    "real_cuda_events",
]

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device index -> handle
_CURRENT = contextlib.nullcontext()  # reusable and reentrant: one for every submit
_TORCH_CURRENT_DEVICE = torch.cuda.current_device  # torch's own (tests may replace it)
_get_device = getattr(torch._C, "_cuda_getDevice", None)  # what it returns after _lazy_init


class CurrentStream:
    """``current()``: the device's current stream as a ``torch.cuda.Stream`` (what
    ``Event.record`` takes). ``torch.cuda.current_stream`` builds a new object on every call,
    and ``Event.record()`` without a stream calls it (9.0 us against 2.6 us with a stream on the
    H200 host; BENCHMARKS.md, round 4 session 7); the raw handle costs ~0.3 us, so the object is
    rebuilt only when the handle changed. Without the raw reader (a CPU build, a test's fake
    CUDA) every call builds the object."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._index = torch.device(device).index or 0
        self._stream: Any = None
        self._raw: int | None = None

    def current(self) -> Any:
        raw = _raw_stream(self._index) if _raw_stream is not None else None
        if raw is None or raw != self._raw:
            self._stream = torch.cuda.current_stream(self._device)
            self._raw = raw
        return self._stream


def device_is_current(device: torch.device) -> bool:
    """Whether ``device`` (with an index) is the current CUDA device (no switch needed).

    The current device is read by torch's C reader (``torch._C._cuda_getDevice``) straight,
    three Python frames fewer than ``torch.cuda.current_device()``, which is ``_lazy_init()``
    then that reader: the reader itself initializes CUDA first where torch has not
    (``device_lazy_init``: torch's ``_lazy_init``, so before initialization and in a forked
    child, where a fork handler marks CUDA uninitialized, it does and raises what
    ``current_device()`` does; ``tests/transfer/test_cuda_current.py`` checks both on a GPU).
    Where ``current_device`` is not torch's own (a test's stand-in) or the reader is missing,
    through ``torch.cuda.current_device()``."""
    index = device.index
    if index is None:
        return False
    if _get_device is not None and torch.cuda.current_device is _TORCH_CURRENT_DEVICE:
        return _get_device() == index
    return torch.cuda.current_device() == index


def _resolve(name: str, version: int) -> Any:
    """The driver entry point, or None without cuda-python or a driver."""
    try:
        return cuda_python_resolver(name, version)
    except Exception:
        return None


def device_check(device: torch.device, real_events: bool) -> Callable[[], bool]:
    """``check()``: whether ``device`` is the current CUDA device, as ``device_is_current``.

    Where ``real_events`` (torch's own CUDA classes), kvmgr's C call module builds and the
    driver grants ``cuCtxGetCurrent``: the thread's current driver context read from C (one
    thread-local read, the GIL kept) and compared with the device's primary context, read once
    here with the device made current (``torch.cuda.device``, then ``cudaMemGetInfo``, which
    makes the runtime bind its context). torch keeps the runtime on primary contexts and the
    runtime's current device is the current context's device, so equal handles mean the device
    is current; another handle, or 0 (a thread no runtime call has bound a context on yet), is
    "not current": the caller switches with ``torch.cuda.device``, as it does for another
    device. Where the driver refuses the read, in a forked child (torch's flag: the driver's
    answer there is not to be trusted) or where ``current_device`` is a test's stand-in (at
    construction or at a check), ``device_is_current`` decides (and raises what torch raises);
    elsewhere throughout. (torch's ``_cuda_getDevice`` runs the runtime's code, cold on every
    submit: 9 us median in the H100 step, session 13; this check 6.1, session 15.)
    """
    fallback = functools.partial(device_is_current, device)
    stand_in = torch.cuda.current_device is not _TORCH_CURRENT_DEVICE  # a test's fake CUDA
    context = None if stand_in or not real_events or device.index is None else native_context()
    if context is None:
        return fallback
    entry = _resolve("cuCtxGetCurrent", 4000)  # PFN_cuCtxGetCurrent_v4000
    if not entry:
        return fallback
    with torch.cuda.device(device):
        torch.cuda.mem_get_info(device)
        primary = context(entry)
    if not primary:  # refused, or still none current
        return fallback
    bad_fork = getattr(torch._C, "_cuda_isInBadFork", None) or (lambda: False)

    def check() -> bool:
        if bad_fork() or torch.cuda.current_device is not _TORCH_CURRENT_DEVICE:
            return device_is_current(device)  # (a forked child: not the driver's word)
        handle = context(entry)
        return device_is_current(device) if handle is None else handle == primary

    return check


def on_device(device: torch.device) -> Any:
    """``torch.cuda.device(device)`` unless it is already current (saves a device switch)."""
    return _CURRENT if device_is_current(device) else torch.cuda.device(device)


def real_cuda_events() -> bool:
    """Whether ``torch.cuda.Event`` is torch's own CUDA event class (not a test's stand-in)."""
    base, event = getattr(torch._C, "_CudaEventBase", None), torch.cuda.Event
    return base is not None and isinstance(event, type) and issubclass(event, base)


def _record_by_method(event: Any, stream: Any) -> None:
    event.record(stream)


def _wait_by_method(event: Any, stream: Any) -> None:
    stream.wait_event(event)


class DriverEvents:
    """``record(event, stream)`` / ``wait(event, stream)`` for torch's own CUDA events and
    streams through the driver's ``cuEventRecord`` / ``cuStreamWaitEvent`` called from C
    (:mod:`kvmgr.transfer.driver_call`; a ``cudaEvent_t`` / ``cudaStream_t`` is the driver's
    ``CUevent`` / ``CUstream``): past torch's ``CUDAGuard`` and the runtime's layer, one C call
    each. The caller is on the event's device (``on_device``), as torch's record requires too.
    An event torch has not created yet (handle 0: it makes the CUDA event at its first record)
    is recorded, or waited on (a no-op then), by torch's own methods; so is a call the driver
    refused with ``CUDA_ERROR_INVALID_CONTEXT`` (a thread on which no CUDA runtime call made the
    device's context current yet: the refused call enqueued nothing, torch's makes it current).

    Args:
        call: ``driver_call.native_call()``.
        record_at, wait_at: the addresses of ``cuEventRecord`` and ``cuStreamWaitEvent``.
        record, wait: torch's ``_CudaEventBase.record`` / ``.wait`` (``(event, stream)``).

    Raises (``record``, ``wait``):
        RuntimeError: the driver refused the call (as torch's methods raise).
    """

    def __init__(self, call: Any, record_at: int, wait_at: int, record: Any, wait: Any) -> None:
        self._call, self._record_at, self._wait_at = call, record_at, wait_at
        self._torch_record, self._torch_wait = record, wait

    def record(self, event: Any, stream: Any) -> None:
        handle = event.cuda_event
        code = self._call(self._record_at, handle, stream.cuda_stream) if handle else _NO_CONTEXT
        if code == _NO_CONTEXT:
            self._torch_record(event, stream)
        elif code:
            raise RuntimeError(f"cuEventRecord failed: {_error_name(code)}")

    def wait(self, event: Any, stream: Any) -> None:
        handle = event.cuda_event
        code = self._call(self._wait_at, stream.cuda_stream, handle, 0) if handle else _NO_CONTEXT
        if code == _NO_CONTEXT:
            self._torch_wait(event, stream)
        elif code:
            raise RuntimeError(f"cuStreamWaitEvent failed: {_error_name(code)}")


def event_calls(real_events: bool) -> tuple[Any, Any]:
    """``(record, wait)``, each called ``(event, stream)`` with a stream given, for
    ``real_events`` where ``torch.cuda.Event`` and ``torch.cuda.Stream`` are torch's own
    classes: ``DriverEvents``' where the C call module builds and the driver grants both entry
    points, else torch's C methods (``torch._C._CudaEventBase.record`` / ``.wait``: their Python
    ``Event.record``, ``Stream.wait_event`` and ``Event.wait`` only pass the stream on). Anything
    else (a subclass of torch's event, a test's stand-ins) gets the objects' own methods."""
    cuda, base = torch.cuda, getattr(torch._C, "_CudaEventBase", None)
    streams = getattr(cuda, "streams", None)
    record, wait = getattr(base, "record", None), getattr(base, "wait", None)  # CPU torch: none
    if not (
        real_events and record is not None and wait is not None and streams is not None
        and cuda.Event is streams.Event and cuda.Stream is streams.Stream
    ):  # fmt: skip
        return _record_by_method, _wait_by_method
    call = native_call()
    entries = [_resolve(name, version) for name, version in _EVENT_ENTRIES]
    if call is None or not all(entries):  # no cuda-python, no driver: torch's methods
        return record, wait
    driver = DriverEvents(call, int(entries[0]), int(entries[1]), record, wait)  # type: ignore[arg-type]
    return driver.record, driver.wait


_EVENT_ENTRIES = (("cuEventRecord", 2000), ("cuStreamWaitEvent", 3020))  # PFN_..._v2000, v3020
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread
