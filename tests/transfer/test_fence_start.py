"""A batch's fence record, its wait and its start record in one C call
(``DriverEvents.fence_start``, ``driver_call.native_fence_start``): the same driver calls in the
same order, the same torch fallbacks and the same errors as the three calls one by one; and
``CopyStreams.submit`` takes it only where the general path would make exactly those calls."""

from __future__ import annotations

import concurrent.futures
import ctypes
from typing import Any

import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib

from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import driver_call
from kvmgr.transfer.cuda_current import DriverEvents, event_calls, fused_fence
from kvmgr.transfer.cuda_engine import CudaBatchEngine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, build_plan

call, fence_start = driver_call.native_call(), driver_call.native_fence_start()
needs_c = pytest.mark.skipif(fence_start is None, reason="the C module does not build here")
_U = ctypes.c_uint64


class _Event:
    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class _Entries:
    """ctypes ``cuEventRecord`` / ``cuStreamWaitEvent`` stand-ins that log their calls and
    answer the codes given (0 once they run out); torch's record / wait log too."""

    def __init__(self, codes: list[int]) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.codes = codes
        self._record = ctypes.CFUNCTYPE(ctypes.c_int, _U, _U)(lambda *a: self._answer("rec", a))
        self._wait = ctypes.CFUNCTYPE(ctypes.c_int, _U, _U, _U)(lambda *a: self._answer("wait", a))

    def _answer(self, name: str, args: tuple[int, ...]) -> int:
        self.log.append((name, *args))
        return self.codes.pop(0) if self.codes else 0

    def driver(self, fused: Any) -> DriverEvents:
        at = [ctypes.cast(f, ctypes.c_void_p).value for f in (self._record, self._wait)]
        return DriverEvents(call, at[0], at[1],
                            lambda e, s: self.log.append(("torch-rec", e.cuda_event, s.cuda_stream)),
                            lambda e, s: self.log.append(("torch-wait", e.cuda_event, s.cuda_stream)),
                            fused)  # fmt: skip


def _run(codes: list[int], fused: Any, events: tuple[int, int] = (0xF1, 0x51)) -> tuple[Any, ...]:
    entries = _Entries(list(codes))
    fence, start = _Event(events[0]), _Event(events[1])
    try:
        entries.driver(fused).fence_start(fence, _Stream(0xC0), _Stream(0xD0), start)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return entries.log, error


@needs_c
def test_one_c_call_makes_the_three_calls_in_order() -> None:
    log, error = _run([], fence_start)
    assert error is None
    assert log == [("rec", 0xF1, 0xC0), ("wait", 0xD0, 0xF1, 0), ("rec", 0x51, 0xD0)]
    assert _run([], None) == (log, None)  # one by one: the same calls


@needs_c
@pytest.mark.parametrize("step", [0, 1, 2])
@pytest.mark.parametrize("code", [201, 400])  # no context current here; an invalid handle
def test_a_refused_step_resumes_or_raises_as_the_calls_one_by_one(step: int, code: int) -> None:
    codes = [0] * step + [code]
    fused, single = _run(codes, fence_start), _run(codes, None)
    assert fused == single
    log, error = fused
    assert log[step][0] in ("rec", "wait")
    if code == 201:  # torch's own call for that step, the driver's for the later ones
        assert error is None and log[step + 1][0].startswith("torch-") and len(log) == 4
    else:  # the later steps not made
        assert error is not None and len(log) == step + 1


@needs_c
@pytest.mark.parametrize("events", [(0, 0x51), (0xF1, 0)])
def test_an_event_torch_has_not_made_yet_goes_one_by_one(events: tuple[int, int]) -> None:
    assert _run([], fence_start, events) == _run([], None, events)


def test_fused_fence_only_behind_driver_events() -> None:
    driver = DriverEvents(lambda *a: 0, 1, 2, None, None, None)
    assert fused_fence(driver.record) == driver.fence_start
    assert fused_fence(lambda e, s: None) is None and fused_fence(print) is None


def _submit_ops(fake: FakeCuda, fused: bool, wait_for: bool, compute: bool) -> list[Any]:
    """The logged operations of one submit (a second submit after the first ended)."""
    lib = FakeDriverLib()
    lib.calls = fake.log
    driver = CopyDriver(lib.resolver((12080, 13000)), driver_version=13000)
    kwargs = {"compute_stream": fake.compute} if compute else {}
    rng = np.random.default_rng(5)
    src = [torch.from_numpy(rng.integers(0, 256, (8, 64), dtype=np.uint8)) for _ in range(2)]
    dst = [torch.zeros((8, 64), dtype=torch.uint8) for _ in range(2)]
    plan = lambda: build_plan(Direction.D2H, KVLayout.from_tensors(src),  # noqa: E731
                              KVLayout.from_tensors(dst), np.array([1, 4]), np.array([0, 6]))  # fmt: skip
    with CudaBatchEngine(driver=driver, **kwargs) as engine:
        streams = engine._streams
        if fused:  # what the C call does, on the fake's objects
            streams._fence_start = lambda f, cur, copy, start: (
                fake.log.append(("fused",)),
                f.record(cur),
                copy.wait_event(f),
                start.record(copy),
            )
        first = engine.submit(plan())
        first.future.result(timeout=5)
        fake.log.clear()
        engine.submit(plan(), wait_for=[first] if wait_for else ()).future.result(timeout=5)
        ops = [e[:1] + tuple(type(x).__name__ for x in e[1:]) if isinstance(e, tuple) else "batch"
               for e in fake.log]  # fmt: skip
    assert all(torch.equal(d[[0, 6]], s[[1, 4]]) for s, d in zip(src, dst))
    return ops


@pytest.mark.parametrize("wait_for", [False, True])
@pytest.mark.parametrize("compute", [False, True])
def test_submit_fuses_only_where_the_general_path_makes_those_three_calls(
    monkeypatch: pytest.MonkeyPatch, wait_for: bool, compute: bool
) -> None:
    fake = FakeCuda().install(monkeypatch)
    general = _submit_ops(fake, False, wait_for, compute)
    fused = _submit_ops(fake, True, wait_for, compute)
    took = fused[:1] == [("fused",)]
    assert took is (not wait_for and not compute)
    assert (fused[1:] if took else fused) == general
    waits = 1 + wait_for  # the fence's, then the earlier batch's end event (fake events)
    assert general[: 2 + waits] == [("record", "Event", "Stream"),
                                    *[("wait", "Stream", "Event")] * waits,
                                    ("record", "Event", "Stream")]  # fmt: skip


def _gpu_fused() -> Any:
    record, _ = event_calls(True)
    fused = fused_fence(record)
    if fused is None:
        pytest.skip("no DriverEvents here (the C modules or the entry points are missing)")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for event in events:  # torch makes the CUDA events at their first record
        event.record(side)
    side.synchronize()
    return fused, side, events


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fence_start_orders_a_side_stream_after_the_current_one() -> None:
    fused, side, (fence, start, done) = _gpu_fused()
    src = torch.full((1 << 22,), 7, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda._sleep(50_000_000)  # the current stream busy, then the value changes
    src.add_(1)
    fused(fence, torch.cuda.current_stream(), side, start)
    with torch.cuda.stream(side):
        dst.copy_(src)
    done.record(side)
    done.synchronize()
    assert fence.query() and bool((dst == 8).all())
    assert start.elapsed_time(done) >= 0.0  # the start event was recorded on the side stream


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fence_start_from_a_thread_that_made_no_cuda_call_yet() -> None:
    fused, side, (fence, start, _) = _gpu_fused()
    current = torch.cuda.current_stream()
    with concurrent.futures.ThreadPoolExecutor(1) as fresh:  # a thread with no context yet
        fresh.submit(lambda: [fused(fence, current, side, start) for _ in range(2)]).result(30)
    side.synchronize()
    assert fence.query() and start.query()


@needs_c
def test_the_c_calls_refuse_bad_arguments_before_calling() -> None:
    fused = driver_call.native_fenced_batch()
    with pytest.raises(TypeError, match="fence_start"):
        fence_start(1, 2, 3)
    with pytest.raises(TypeError, match="15 arguments"):
        fused(*range(1, 7))
    with pytest.raises(ValueError, match="NULL"):
        fence_start(1, 0, 3, 4, 5, 6)
    with pytest.raises(ValueError, match="NULL"):
        fused(1, 2, 0, *range(12))
    with pytest.raises(TypeError):
        fence_start(1, 2, 3, 4, 5, "six")
