"""The current CUDA device and stream, read cheaply on every submit (private to
``kvmgr.transfer``).

Offers:
    CurrentStream   the device's current stream as a ``torch.cuda.Stream``, rebuilt only when
                    the raw current-stream handle changes
    on_device       ``torch.cuda.device(device)`` unless it is already current
    event_calls     ``(record, wait)`` of an event on a stream: torch's C methods where they
                    are torch's own classes
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["CurrentStream", "event_calls", "on_device"]

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device index -> handle
_CURRENT = contextlib.nullcontext()  # reusable and reentrant: one for every submit


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


def on_device(device: torch.device) -> Any:
    """``torch.cuda.device(device)`` unless it is already current (saves a device switch)."""
    if device.index is not None and torch.cuda.current_device() == device.index:
        return _CURRENT
    return torch.cuda.device(device)


def _record_by_method(event: Any, stream: Any) -> None:
    event.record(stream)


def _wait_by_method(event: Any, stream: Any) -> None:
    stream.wait_event(event)


def event_calls(real_events: bool) -> tuple[Any, Any]:
    """``(record, wait)``, each called ``(event, stream)`` with a stream given: torch's C
    methods (``torch._C._CudaEventBase.record`` / ``.wait``) where ``real_events`` and
    ``torch.cuda.Event`` and ``torch.cuda.Stream`` are torch's own classes (their Python
    ``Event.record``, ``Stream.wait_event`` and ``Event.wait`` only pass the stream on: three
    Python frames fewer per submit), else the objects' own methods (a subclass of torch's event,
    a test's stand-ins)."""
    cuda, base = torch.cuda, getattr(torch._C, "_CudaEventBase", None)
    streams = getattr(cuda, "streams", None)
    record, wait = getattr(base, "record", None), getattr(base, "wait", None)  # CPU torch: none
    if (
        real_events and record is not None and wait is not None and streams is not None
        and cuda.Event is streams.Event and cuda.Stream is streams.Stream
    ):  # fmt: skip
        return record, wait
    return _record_by_method, _wait_by_method
