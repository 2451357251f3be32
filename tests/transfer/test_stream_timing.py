"""``CopyStreams``' events per batch: a fence (also the start) and an end event, no start record
unless the batch waits for other batches; ``device_s`` from the later of the fence and the
previous batch's end; the held-back pair (issue 27, helper stepcuda6).

The fake events take a device time stamp at each record from the test's list (a re-record
overwrites it), so each batch's ``device_s`` says which events timed it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib

from kvmgr.errors import TransferError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import streams
from kvmgr.transfer.cuda_engine import CudaBatchEngine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, build_plan


class ClockedCuda(FakeCuda):
    """``FakeCuda`` whose events take the next of ``stamps`` (ms) at each record, report
    ``end.t - start.t`` as their elapsed time, and raise at ``synchronize`` when ``broken``."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[float] = []
        fake, base = self, self.Event

        class Event(base):  # type: ignore[misc,valid-type]
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                super().__init__(enable_timing, blocking)
                self.timing, self.t, self.broken = enable_timing, None, False

            def record(self, stream: Any = None) -> None:
                super().record(stream)
                self.t = fake.stamps.pop(0)

            def synchronize(self) -> None:
                super().synchronize()
                if self.broken:
                    raise RuntimeError("an illegal address was encountered")

            def elapsed_time(self, end: Any) -> float:
                assert self.timing and end.timing and self.t is not None and end.t is not None
                return end.t - self.t

        self.Event = Event


@pytest.fixture(params=[False, True], ids=["fresh-pairs", "pooled"])
def clocked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ClockedCuda:
    monkeypatch.setattr(streams, "_real_cuda_events", lambda: request.param)
    return ClockedCuda().install(monkeypatch)  # type: ignore[return-value]


def _engine(fake: FakeCuda) -> CudaBatchEngine:
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver((12080, 13000)), driver_version=13000)
    driver.fake_lib = lib  # type: ignore[attr-defined]
    lib.calls = fake.log
    return CudaBatchEngine(driver=driver)


_TENSORS = [torch.zeros(8, 64, dtype=torch.uint8) for _ in range(4)]  # alive: the fake copies


def _plan(direction: Direction, first: int) -> Any:
    src, dst = KVLayout.from_tensors(_TENSORS[:2]), KVLayout.from_tensors(_TENSORS[2:])
    ids = np.array([first], dtype=np.int64)
    return build_plan(direction, src, dst, ids, ids)


def _ops(fake: FakeCuda) -> list[tuple[str, Any, Any]]:
    return [(e[0], e[1], e[2]) if isinstance(e, tuple) else ("batch", None, None) for e in fake.log]


def test_a_batch_records_its_fence_and_end_only_and_is_timed_from_the_later_start(
    clocked: ClockedCuda,
) -> None:
    engine = _engine(clocked)
    with engine:
        stream = engine.stream(Direction.D2H)
        gate = clocked.gate()  # batch a runs until set: b and c queue behind it
        # a: fence at 0, end at 10; b: fence at 2, but its stream is busy with a until 10;
        # c: fence at 30 (a long compute step), end at 33
        clocked.stamps[:] = [0.0, 10.0, 2.0, 15.0, 30.0, 33.0]
        clocked.log.clear()
        handles = [engine.submit(_plan(Direction.D2H, i)) for i in range(3)]
        fence = clocked.log[0][1]
        assert _ops(clocked)[:4] == [
            ("record", fence, clocked.compute),  # the fence on the compute stream, also the start
            ("wait", stream, fence),
            ("batch", None, None),
            ("record", handles[0].end_event, stream),  # no start record on the copy stream
        ]
        assert [op[0] for op in _ops(clocked)] == ["record", "wait", "batch", "record"] * 3
        gate.set()
        seconds = [h.future.result(timeout=5).device_s for h in handles]
        assert seconds == pytest.approx([0.010, 0.005, 0.003])
        assert engine.statistics().device_s_d2h == pytest.approx(0.018)
        pool = engine._streams._pools[Direction.D2H]
        if engine._streams._pooled:  # a and b back, c held for the next batch's timing
            assert len(pool) == 2 and handles[2].end_event not in {p[1] for p in pool}
            clocked.stamps[:] = [50.0, 51.0]
            engine.submit(_plan(Direction.D2H, 4)).future.result(timeout=5)
            assert handles[2].end_event in {p[1] for p in pool}  # c's pair came back
        else:
            assert pool == []


def test_after_a_device_error_the_next_batch_is_timed_from_its_fence_and_the_pair_dropped(
    clocked: ClockedCuda,
) -> None:
    engine = _engine(clocked)
    with engine:
        gate = clocked.gate()
        # a: 0 -> 10; b: fence 5, end 15, fails on the device; c: fence 12, end 40 (its
        # stream's previous end, b's 15, must not time it: 28 ms, not 25)
        clocked.stamps[:] = [0.0, 10.0, 5.0, 15.0, 12.0, 40.0]
        handles = [engine.submit(_plan(Direction.D2H, i)) for i in range(3)]
        handles[1].end_event.broken = True
        gate.set()
        assert handles[0].future.result(timeout=5).device_s == pytest.approx(0.010)
        with pytest.raises(TransferError, match="failed on the device"):
            handles[1].future.result(timeout=5)
        assert handles[2].future.result(timeout=5).device_s == pytest.approx(0.028)
        ends = {p[1] for p in engine._streams._pools[Direction.D2H]}
        assert handles[1].end_event not in ends  # never reused after a device error
        assert (handles[0].end_event in ends) is engine._streams._pooled


def test_a_batch_that_waits_for_another_records_its_start_after_the_waits(
    clocked: ClockedCuda,
) -> None:
    engine = _engine(clocked)
    with engine:
        gate = threading.Event()
        clocked.gates.append(gate)  # the store runs until set
        clocked.stamps[:] = [0.0, 40.0]
        store = engine.submit(_plan(Direction.D2H, 0))
        # the load: fence at 1, its start after the store's end at 40, end at 45
        clocked.stamps[:] = [1.0, 41.0, 45.0]
        clocked.log.clear()
        load = engine.submit(_plan(Direction.H2D, 1), wait_for=[store])
        h2d = engine.stream(Direction.H2D)
        fence = clocked.log[0][1]
        assert _ops(clocked) == [
            ("record", fence, clocked.compute),
            ("wait", h2d, fence),
            ("wait", h2d, store.end_event),
            ("record", fence, h2d),  # the fence event again, now the start after the waits
            ("batch", None, None),
            ("record", load.end_event, h2d),
        ]
        gate.set()
        assert store.future.result(timeout=5).device_s == pytest.approx(0.040)
        assert load.future.result(timeout=5).device_s == pytest.approx(0.004)
        # a resolved handle's pooled event is not waited for: no start record then (a fresh
        # pair's is, a no-op on the device, and the start follows that wait)
        pooled = engine._streams._pooled
        clocked.stamps[:] = [50.0, 52.0] if pooled else [50.0, 51.0, 52.0]
        clocked.log.clear()
        again = engine.submit(_plan(Direction.H2D, 2), wait_for=[store])
        waits = [] if pooled else ["wait", "record"]
        assert [op[0] for op in _ops(clocked)] == ["record", "wait", *waits, "batch", "record"]
        assert again.future.result(timeout=5).device_s == pytest.approx(0.002 if pooled else 0.001)


@pytest.mark.parametrize(
    "device",
    [None, torch.device("cuda", 1), torch.device("cuda", 0)],
    ids=["unknown", "other", "same"],
)
def test_a_compute_stream_of_another_device_keeps_a_fence_of_its_own_and_a_start_record(
    clocked: ClockedCuda, device: Any
) -> None:
    """A fence recorded on another device cannot time a copy here: there each batch's start is
    recorded on the copy stream after its fence's wait, as before, and times it. A compute
    stream of the engine's device is fenced as the current stream is (no start record)."""
    compute = clocked.Stream()
    if device is not None:
        compute.device = device
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver((12080, 13000)), driver_version=13000)
    driver.fake_lib = lib  # type: ignore[attr-defined]
    lib.calls = clocked.log
    with CudaBatchEngine(0, compute_stream=compute, driver=driver) as engine:
        stream = engine.stream(Direction.D2H)
        for first in range(2):
            clocked.stamps[:] = [20.0 * first + t for t in (0.0, 7.0, 10.0)]  # fence, start, end
            clocked.log.clear()
            handle = engine.submit(_plan(Direction.D2H, first))
            if device == torch.device("cuda", 0):
                assert [op[0] for op in _ops(clocked)] == ["record", "wait", "batch", "record"]
                assert engine._streams._fences is None
                assert handle.future.result(timeout=5).device_s == pytest.approx(0.007)
                continue
            fence, start = clocked.log[0][1], clocked.log[2][1]
            assert _ops(clocked) == [
                ("record", fence, compute),
                ("wait", stream, fence),
                ("record", start, stream),
                ("batch", None, None),
                ("record", handle.end_event, stream),
            ]
            assert fence is not start and fence is engine._streams._fences[Direction.D2H]
            assert handle.future.result(timeout=5).device_s == pytest.approx(0.003)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_device_s_counts_the_copy_only_not_the_compute_before_it_nor_the_batch_ahead() -> None:
    """On the device: a store behind a long kernel on the compute stream is not timed from its
    fence's record (the kernel's time is not in it), and a second store queued behind the first
    is not timed from its own fence either (the first one's copy is not in it)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gpu = [torch.randint(0, 256, (64, 1 << 20), dtype=torch.uint8, device=dev) for _ in range(2)]
    host = [[torch.empty(64, 1 << 20, dtype=torch.uint8).pin_memory() for _ in range(2)] for _ in range(2)]  # fmt: skip
    ids = np.arange(64)
    with CudaBatchEngine(dev) as engine:
        for _ in range(2):  # the second round on pooled (re-recorded) events
            plans = [
                build_plan(
                    Direction.D2H, KVLayout.from_tensors(gpu), KVLayout.from_tensors(h), ids, ids
                )
                for h in host
            ]
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(200_000_000)  # ~0.1 s of compute before the stores' fences
            end.record()
            first, second = (engine.submit(p) for p in plans)
            a, b = first.future.result(timeout=30), second.future.result(timeout=30)
            sleep_s = begin.elapsed_time(end) / 1e3
            assert 0 < a.device_s < sleep_s / 4, (a.device_s, sleep_s)
            assert 0.5 < b.device_s / a.device_s < 1.6, (a.device_s, b.device_s)
            for h in host:
                assert all(torch.equal(g.cpu(), t) for g, t in zip(gpu, h))
