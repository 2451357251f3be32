"""CurrentStream: the current stream's object is rebuilt only when the raw handle changes;
event_calls: the driver's record and wait from C (DriverEvents) or torch's C methods only for
torch's own event and stream classes; events torch has not made, and threads with no current
context, go through torch."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from kvmgr.transfer import cuda_current
from kvmgr.transfer.cuda_current import CurrentStream, DriverEvents, event_calls
from kvmgr.transfer.driver_call import native_call


def test_the_stream_object_is_rebuilt_only_when_the_raw_handle_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = {"handle": 0x10}
    built: list[object] = []

    def current_stream(device: object = None) -> object:
        built.append(stream := object())
        return stream

    monkeypatch.setattr(cuda_current, "_raw_stream", lambda index: raw["handle"])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    current = CurrentStream(torch.device("cuda", 0))
    first = current.current()
    assert current.current() is first and len(built) == 1  # same handle: the same object
    raw["handle"] = 0x20  # the caller entered torch.cuda.stream(other)
    second = current.current()
    assert second is not first and len(built) == 2
    raw["handle"] = 0x10  # and left it: the first handle's object is built again
    assert current.current() is built[-1] and len(built) == 3


def test_without_the_raw_reader_every_call_builds_the_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[object] = []
    monkeypatch.setattr(cuda_current, "_raw_stream", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: built.append(0) or built)
    current = CurrentStream(torch.device("cuda", 0))
    current.current()
    current.current()
    assert len(built) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_object_follows_the_current_stream() -> None:
    current = CurrentStream(torch.device("cuda", 0))
    assert current.current() == torch.cuda.current_stream()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        assert current.current() == side
    assert current.current() == torch.cuda.current_stream()


def test_event_calls_are_torchs_c_methods_only_for_torchs_own_classes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = torch._C._CudaEventBase
    by_method = event_calls(False)  # a test's stand-in events: each object's own methods
    if hasattr(base, "record"):  # a CUDA build of torch (a CPU build has a placeholder class)
        record, wait = event_calls(True)
        if native_call() is not None:  # the driver's entry points from C
            assert isinstance(record.__self__, DriverEvents) and wait.__self__ is record.__self__
        else:
            assert (record, wait) == (base.record, base.wait)
        monkeypatch.setattr(cuda_current, "native_call", lambda: None)
        assert event_calls(True) == (base.record, base.wait) != by_method
        monkeypatch.undo()
    else:
        assert event_calls(True) == by_method
    log: list[tuple[str, object, object]] = []

    class Event:
        def record(self, stream: object = None) -> None:
            log.append(("record", self, stream))

    class Stream:
        def wait_event(self, event: object) -> None:
            log.append(("wait", self, event))

    record, wait = by_method
    event, stream = Event(), Stream()
    record(event, stream)
    wait(event, stream)
    assert log == [("record", event, stream), ("wait", stream, event)]

    class LoggingEvent(torch.cuda.Event):  # a subclass of torch's event: its record must run
        pass

    monkeypatch.setattr(torch.cuda, "Event", LoggingEvent)
    assert event_calls(True) == by_method
    monkeypatch.setattr(torch.cuda, "Event", torch.cuda.streams.Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)  # another stream class: its wait_event
    assert event_calls(True) == by_method


class _Event:
    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


class _Stream:
    cuda_stream = 0x5EED


def test_driver_events_call_the_entry_points_and_leave_the_rest_to_torch() -> None:
    calls: list[tuple[int, ...]] = []
    codes = [0, 0, 400, 1]  # CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE
    torch_calls: list[tuple[str, object, object]] = []
    driver = DriverEvents(
        lambda *args: calls.append(args) or codes.pop(0), 0x100, 0x200,
        lambda event, stream: torch_calls.append(("record", event, stream)),
        lambda event, stream: torch_calls.append(("wait", event, stream)),
    )  # fmt: skip
    event, fresh, stream = _Event(0xE1), _Event(0), _Stream()
    driver.record(event, stream)
    driver.wait(event, stream)
    assert calls == [(0x100, 0xE1, 0x5EED), (0x200, 0x5EED, 0xE1, 0)]  # (event, stream); flags 0
    driver.record(fresh, stream)  # torch makes the CUDA event at its first record
    driver.wait(fresh, stream)
    assert torch_calls == [("record", fresh, stream), ("wait", fresh, stream)] and len(calls) == 2
    with pytest.raises(RuntimeError, match="cuEventRecord failed"):
        driver.record(event, stream)
    with pytest.raises(RuntimeError, match="cuStreamWaitEvent failed"):
        driver.wait(event, stream)
    assert len(calls) == 4 and len(torch_calls) == 2
    codes.extend([201, 201])  # no context current on this thread: torch's call makes it so
    driver.record(event, stream)
    driver.wait(event, stream)
    assert torch_calls[2:] == [("record", event, stream), ("wait", event, stream)]
    assert calls[4:] == [(0x100, 0xE1, 0x5EED), (0x200, 0x5EED, 0xE1, 0)]


def _made_by_torch(side: torch.cuda.Stream, *timing: bool) -> list[torch.cuda.Event]:
    """Events torch made (its first record creates the CUDA event; later ones go to the
    driver through ``DriverEvents`` where the C call builds)."""
    events = [torch.cuda.Event(enable_timing=t) for t in timing]
    for event in events:
        event.record(side)
    side.synchronize()
    assert all(event.cuda_event for event in events)
    return events


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_event_calls_order_a_side_stream_after_the_current_one() -> None:
    record, wait = event_calls(True)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    fence, start, done = _made_by_torch(side, False, True, True)
    src = torch.full((1 << 22,), 7, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda._sleep(50_000_000)  # the current stream busy, then the value changes
    src.add_(1)
    record(fence, torch.cuda.current_stream())
    wait(fence, side)
    record(start, side)
    with torch.cuda.stream(side):
        dst.copy_(src)
    record(done, side)
    done.synchronize()
    assert fence.query() and int(dst[0]) == 8 and bool((dst == 8).all())
    assert start.elapsed_time(done) >= 0.0  # torch still reads the events it made


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_event_calls_from_a_thread_that_made_no_cuda_call_yet() -> None:
    record, wait = event_calls(True)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    (event,) = _made_by_torch(side, False)
    errors: list[BaseException] = []

    def fresh() -> None:  # no context current here until a runtime call makes it so
        try:
            record(event, side)
            wait(event, side)
            record(event, side)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=fresh)
    thread.start()
    thread.join(30)
    assert not errors
    side.synchronize()
    assert event.query()


def test_on_device_reads_the_device_from_c_only_where_current_device_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[str] = []

    def torch_current_device() -> int:  # stands in for torch's own: _lazy_init, then the C read
        reads.append("python")
        return 1

    def c_reader() -> int:
        reads.append("c")
        return 1

    switched: list[object] = []
    monkeypatch.setattr(torch.cuda, "current_device", torch_current_device)
    monkeypatch.setattr(torch.cuda, "device", lambda device: switched.append(device) or "guard")
    monkeypatch.setattr(cuda_current, "_TORCH_CURRENT_DEVICE", torch_current_device)
    monkeypatch.setattr(cuda_current, "_get_device", c_reader)
    on = cuda_current.on_device
    assert on(torch.device("cuda", 1)) is cuda_current._CURRENT and reads == ["c"]
    assert on(torch.device("cuda", 0)) == "guard" and switched == [torch.device("cuda", 0)]
    # initialized or not, forked or not: the C reader (it initializes CUDA itself: GPU tests)
    monkeypatch.setattr(torch.cuda, "_initialized", False, raising=False)
    reads.clear()
    assert on(torch.device("cuda", 1)) is cuda_current._CURRENT and reads == ["c"]
    # a stand-in current_device, or no C reader: torch's own path
    for name in ("_TORCH_CURRENT_DEVICE", "_get_device"):
        reads.clear()
        with monkeypatch.context() as m:
            m.setattr(cuda_current, name, None)
            assert on(torch.device("cuda", 1)) is cuda_current._CURRENT and reads == ["python"]


_CHILD = """
import sys, torch
from kvmgr.transfer.cuda_current import device_is_current
def outcome(fn):
    try:
        return repr(fn())
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc).splitlines()[0]
dev = torch.device("cuda", 0)
if sys.argv[1] == "fork":  # CUDA initialized, then a forked child asks
    import os
    from kvmgr.transfer.cuda_current import device_check
    torch.cuda.current_device()
    check = device_check(dev, True)
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, (outcome(torch.cuda.current_device) + "|" + outcome(lambda: device_is_current(dev)) + "|" + outcome(check)).encode())
        os._exit(0)
    os.wait()
    print(os.read(r, 4096).decode())
else:  # nothing initialized yet: the C reader initializes CUDA as current_device() would
    first = outcome(lambda: device_is_current(dev))
    print(first + "|" + repr(torch.cuda.is_initialized()) + "|" + outcome(torch.cuda.current_device))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_device_is_current_reads_as_current_device_in_a_forked_child_and_before_init() -> None:
    import subprocess
    import sys

    def run(mode: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                             timeout=120, check=True)  # fmt: skip
        return out.stdout.strip().splitlines()[-1].split("|")

    torch_says, ours, checked = run("fork")
    assert "forked subprocess" in torch_says and ours == torch_says == checked  # torch's error
    assert run("fresh") == ["True", "True", "0"]


def _driver_context(state: dict[str, int]) -> tuple[object, int]:
    """A stand-in ``cuCtxGetCurrent`` (a C function pointer): writes ``state["handle"]`` and
    returns ``state["code"]``."""
    import ctypes

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    def get(out: object) -> int:
        out[0] = state["handle"]  # type: ignore[index]
        return state["code"]

    return get, ctypes.cast(get, ctypes.c_void_p).value or 0


def test_native_context_returns_the_handle_or_none_where_refused() -> None:
    context = cuda_current.native_context()
    if context is None:
        pytest.skip("kvmgr's C call module does not build here")
    state = {"handle": 0x7F00AB, "code": 0}
    keep, entry = _driver_context(state)
    assert context(entry) == 0x7F00AB
    state["handle"] = 0  # no context current on the thread
    assert context(entry) == 0
    state["code"] = 3  # CUDA_ERROR_NOT_INITIALIZED (a forked child)
    assert context(entry) is None
    with pytest.raises(ValueError, match="NULL entry"):
        context(0)
    del keep


def test_device_check_compares_the_current_context_with_the_devices_primary_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if cuda_current.native_context() is None:
        pytest.skip("kvmgr's C call module does not build here")
    state = {"handle": 0xC0, "code": 0}  # the primary context, current while it is read
    keep, entry = _driver_context(state)
    entered: list[object] = []
    readers: list[object] = []
    monkeypatch.setattr(cuda_current, "cuda_python_resolver", lambda name, version: entry)
    monkeypatch.setattr(
        torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext()
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1, 1))
    monkeypatch.setattr(
        cuda_current, "device_is_current", lambda d: readers.append(d) or d.index == 1
    )
    dev = torch.device("cuda", 0)
    check = cuda_current.device_check(dev, True)
    assert entered == [dev]  # the primary context read with the device made current
    assert check() and not readers
    state["handle"] = 0xD0  # another device's context current (torch.cuda.set_device(1))
    assert not check()
    state["handle"] = 0  # a thread with no context yet: switch, as for another device
    assert not check() and not readers
    state["code"] = 3  # the driver refuses: torch's reader decides (and raises as torch does)
    assert not check() and readers == [dev]
    state["code"], state["handle"] = 0, 0xC0
    monkeypatch.setattr(torch._C, "_cuda_isInBadFork", lambda: True, raising=False)
    check = cuda_current.device_check(dev, True)  # (the flag's reader is looked up once)
    assert not check() and readers == [dev, dev]  # a forked child: torch's reader raises
    monkeypatch.setattr(torch._C, "_cuda_isInBadFork", lambda: False, raising=False)
    check = cuda_current.device_check(dev, True)
    assert check() and len(readers) == 2
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # a test's stand-in
    assert not check() and readers == [dev, dev, dev]
    # without torch's own classes, or with no context current at the start: torch's reader
    assert cuda_current.device_check(dev, False)() is False
    state["handle"] = 0
    assert cuda_current.device_check(dev, True)() is False and len(readers) == 5
    del keep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_device_check_agrees_with_torchs_reader() -> None:
    dev = torch.device("cuda", 0)
    check = cuda_current.device_check(dev, True)
    with torch.cuda.device(dev):
        assert check() and cuda_current.device_is_current(dev)
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(check()))  # no context bound yet
    thread.start()
    thread.join()
    assert seen in ([False], [True])  # False: the caller switches (a guard), never wrong
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):
            assert not check() and not cuda_current.device_is_current(dev)
        other = cuda_current.device_check(torch.device("cuda", 1), True)
        with torch.cuda.device(1):
            assert other()
        with torch.cuda.device(dev):
            assert not other()


def test_device_check_under_a_fake_cuda_never_reads_the_primary_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A test's fake CUDA (``current_device`` replaced) on a host with a driver: no device
    switch, no ``mem_get_info`` (torch's real one refuses the fake's device objects: the GPU
    suite's fake-CUDA stream tests failed so), torch's reader decides at each check."""
    if cuda_current.native_context() is None:
        pytest.skip("kvmgr's C call module does not build here")
    state = {"handle": 0xC0, "code": 0}
    keep, entry = _driver_context(state)
    monkeypatch.setattr(cuda_current, "cuda_python_resolver", lambda name, version: entry)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("read the primary context under a fake CUDA")

    monkeypatch.setattr(torch.cuda, "device", refuse)
    monkeypatch.setattr(torch.cuda, "mem_get_info", refuse)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    readers: list[object] = []
    monkeypatch.setattr(cuda_current, "device_is_current", lambda d: readers.append(d) or True)
    dev = torch.device("cuda", 0)
    check = cuda_current.device_check(dev, True)
    assert check() and readers == [dev]
    del keep
