"""A steady DMA batch in one C call (``kvmgr.transfer._fused.FusedBatch``): a program of submits
through ``CopyStreams`` with the fused call and through the same streams without it (the fence
call, ``DmaCopy.issue``, the end record) makes the same driver and event calls with the same
arguments in the same order, copies the same bytes, resolves the same futures with the same
results and errors and counts the same totals; refused event calls and a refused copy included
(both batch ABIs)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib

from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import driver_call
from kvmgr.transfer._fused import FusedBatch
from kvmgr.transfer.cuda_current import DriverEvents
from kvmgr.transfer.cuda_engine import CudaBatchEngine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, build_plan

call, fenced = driver_call.native_call(), driver_call.native_fenced_batch()
pytestmark = pytest.mark.skipif(fenced is None, reason="the C module does not build here")
_U = ctypes.c_uint64


class _Entries:
    """ctypes ``cuEventRecord`` / ``cuStreamWaitEvent`` that log into the fake's log and answer
    ``codes[i]`` for their ``i``-th call (0 otherwise); torch's record / wait log too."""

    def __init__(self, log: list[Any], codes: dict[int, int]) -> None:
        self.log, self.codes, self.n = log, codes, 0
        self._record = ctypes.CFUNCTYPE(ctypes.c_int, _U, _U)(lambda *a: self._answer("rec", a))
        self._wait = ctypes.CFUNCTYPE(ctypes.c_int, _U, _U, _U)(lambda *a: self._answer("wait", a))

    def _answer(self, name: str, args: tuple[int, ...]) -> int:
        self.log.append((name, *args))
        self.n += 1
        return self.codes.get(self.n - 1, 0)

    def events(self) -> DriverEvents:
        at = [ctypes.cast(f, ctypes.c_void_p).value for f in (self._record, self._wait)]
        log = self.log
        return DriverEvents(call, at[0], at[1],
                            lambda e, s: log.append(("torch-rec", e.cuda_event, s.cuda_stream)),
                            lambda e, s: log.append(("torch-wait", e.cuda_event, s.cuda_stream)),
                            driver_call.native_fence_start())  # fmt: skip


def _normalized(log: list[Any]) -> list[Any]:
    """Handles by first appearance (the two runs make their own events and streams)."""
    names: dict[int, int] = {}
    out = []
    for entry in log:
        if isinstance(entry, tuple):
            entry = (entry[0], *(names.setdefault(v, len(names)) if v > 16 else v for v in entry[1:]))  # fmt: skip
        elif "resolve" in entry:
            continue
        out.append(entry)
    return out


def _program(monkeypatch: pytest.MonkeyPatch, fused: bool, abi: int, codes: dict[int, int]) -> Any:
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(fake.Event, "cuda_event", property(lambda e: id(e)), raising=False)
    lib = FakeDriverLib(fail_at=1, code=1, fail_call=3)  # the 4th batch call refused
    driver = CopyDriver(lib.resolver((abi,)), driver_version=13000)
    lib.calls = fake.log
    rng = np.random.default_rng(abi)
    src = [torch.from_numpy(rng.integers(0, 256, (16, 64), dtype=np.uint8)) for _ in range(3)]
    dst = [torch.zeros((16, 64), dtype=torch.uint8) for _ in range(3)]
    layouts = KVLayout.from_tensors(src), KVLayout.from_tensors(dst)
    entries = _Entries(fake.log, codes)
    outcomes: list[Any] = []
    made: list[bool] = []  # per FusedBatch.issue: whether it made the call (not None)
    issue = FusedBatch.issue
    monkeypatch.setattr(
        FusedBatch, "issue", lambda *a: made.append((r := issue(*a)) is not None) or r
    )
    with CudaBatchEngine(driver=driver) as engine:
        streams = engine._streams
        events = entries.events()
        streams._pooled, streams._record, streams._wait = True, events.record, events.wait
        streams._fence_start = events.fence_start
        if not fused:
            streams._fused_for = engine.issuer  # never made: the one-by-one path
        for _ in range(7):
            ids = rng.choice(16, 4, replace=False)
            plan = build_plan(Direction.D2H, *layouts, ids, ids[::-1].copy())
            try:
                handle = engine.submit(plan)
            except RuntimeError as exc:
                outcomes.append(("raised", str(exc)))
                continue
            try:
                r = handle.future.result(timeout=5)
                outcomes.append((r.batch_id, r.num_bytes, r.num_descriptors, r.path))
            except Exception as exc:
                outcomes.append((type(exc).__name__, str(exc), getattr(exc, "fail_index", None)))
        took = sum(made)
        totals = {k: v for k, v in engine.statistics().__dict__.items() if not k.endswith("_s")}
    return _normalized(fake.log), outcomes, [d.clone() for d in dst], totals, took


@pytest.mark.parametrize("abi", [12080, 13000])
@pytest.mark.parametrize(
    "codes",
    [
        {},
        {8: 201},
        {9: 201},
        {6: 201},
        {7: 201},
        {8: 400},
        {9: 400},
        {6: 400},
        {7: 400},
        {10: 201, 16: 201},
    ],
    ids=[
        "clean",
        "fence-ctx",
        "wait-ctx",
        "start-ctx",
        "end-ctx",
        "fence-bad",
        "wait-bad",
        "start-bad",
        "end-bad",
        "two",
    ],
)
def test_the_fused_call_is_the_calls_one_by_one(
    monkeypatch: pytest.MonkeyPatch, abi: int, codes: dict[int, int]
) -> None:
    fused = _program(monkeypatch, True, abi, codes)
    monkeypatch.undo()
    general = _program(monkeypatch, False, abi, codes)
    assert fused[4] >= 5 and not general[4]  # the fused call made, and not in the general run
    assert fused[0] == general[0]
    assert fused[1] == general[1] and fused[3] == general[3]
    assert all(torch.equal(a, b) for a, b in zip(fused[2], general[2]))
    assert any(o[0] == "TransferError" for o in fused[1])  # the refused copy is in the program
    if codes and 400 in codes.values():
        assert any(o[0] == "raised" for o in fused[1])


def test_make_takes_only_a_dma_issuer_behind_driver_events() -> None:
    events = DriverEvents(call, 1, 2, None, None, None)
    lib = FakeDriverLib()
    from kvmgr.transfer.dma import DmaCopy

    dma = DmaCopy(CopyDriver(lib.resolver(), driver_version=13000), "batch", 64)
    assert isinstance(FusedBatch.make(events.record, dma), FusedBatch)
    assert FusedBatch.make(lambda e, s: None, dma) is None
    assert FusedBatch.make(events.record, object()) is None
    no_c = DmaCopy(CopyDriver(lib.resolver(), driver_version=13000, from_c=False), "batch", 64)
    assert FusedBatch.make(events.record, no_c) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_cuda_engine_copies_through_the_fused_call(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[bool] = []
    issue = FusedBatch.issue
    monkeypatch.setattr(FusedBatch, "issue", lambda *a: made.append((r := issue(*a)) is not None) or r)  # fmt: skip
    rng = np.random.default_rng(3)
    src = [torch.randint(0, 256, (32, 4096), dtype=torch.uint8, device="cuda") for _ in range(4)]
    with CudaBatchEngine() as engine:
        dst = [engine.allocate_host(32 * 4096).view(32, 4096) for _ in range(4)]
        for d in dst:
            d.fill_(0xA5)  # poisoned: every block not copied keeps it
        layouts = KVLayout.from_tensors(src), KVLayout.from_tensors(dst)
        expected = [d.clone() for d in dst]
        for _ in range(6):
            gpu, cpu = rng.choice(32, 5, replace=False), rng.choice(32, 5, replace=False)
            engine.submit(build_plan(Direction.D2H, *layouts, gpu, cpu)).future.result(timeout=30)
            for e, s in zip(expected, src):
                e[cpu] = s[gpu].cpu()
        assert all(torch.equal(d, e) for d, e in zip(dst, expected))
        assert engine._streams._fused is not None and sum(made) >= 4, made
        assert engine.statistics().batches_completed == 6
