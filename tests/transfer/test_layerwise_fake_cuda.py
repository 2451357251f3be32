"""Layerwise loads through the real ``CopyStreams`` on fake CUDA (``cuda_fakes``' stand-ins:
streams and events that log, a driver that memmoves host memory): one batch per layer group on
the load stream, ``wait_layer`` a stream wait on that group's end event, a refused launch known
before the first wait."""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib

from kvmgr import LayerLoadError, LayerOrderError, ManagerConfig, OffloadManager
from kvmgr.errors import TransferError
from kvmgr.testing import check_invariants
from kvmgr.transfer import streams
from kvmgr.transfer.cuda_engine import CudaBatchEngine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction

LAYERS = 3


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def _manager(fake: FakeCuda, lib: FakeDriverLib) -> tuple[OffloadManager, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randint(0, 256, (16, 512), dtype=torch.uint8, generator=gen)
              for _ in range(2 * LAYERS)]  # fmt: skip
    driver = CopyDriver(lib.resolver(), driver_version=13000)
    driver.fake_lib = lib  # type: ignore[attr-defined]  # keep the ctypes callbacks alive
    lib.calls = fake.log  # driver calls interleave with stream and event operations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA to pin with: the tier falls back to pageable
        engine = CudaBatchEngine(driver=driver, allow_pageable=True)
        mgr = OffloadManager(caches, ManagerConfig(num_cpu_blocks=16), engine=engine)
    return mgr, caches


def _keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(bytes([i])).digest() for i in range(n)]


async def _stored(mgr: OffloadManager, keys: list[bytes]) -> np.ndarray:
    ids = np.asarray(mgr.allocate("a", len(keys)))
    future = mgr.store_many(ids, keys)
    await mgr.step()
    await future
    return ids


@pytest.mark.asyncio
async def test_wait_layer_is_a_stream_wait_on_its_groups_end_event(fake_cuda: FakeCuda) -> None:
    lib = FakeDriverLib()
    mgr, caches = _manager(fake_cuda, lib)
    async with mgr:
        keys = _keys(4)
        src = await _stored(mgr, keys)
        dst = np.asarray(mgr.allocate("b", 4))
        fake_cuda.log.clear()
        load = mgr.load_layerwise(keys, dst, layers=2)
        h2d = mgr.engine.stream(Direction.H2D)  # type: ignore[attr-defined]
        batches = [e for e in fake_cuda.log if isinstance(e, dict) and "batch" in e]
        assert len(batches) == LAYERS and {b["stream"] for b in batches} == {h2d.cuda_stream}
        ends = [h.end_event for h in load.batches.handles]
        records = [e[1] for e in fake_cuda.log if isinstance(e, tuple) and e[0] == "record"]
        assert [r for r in records if r in ends] == ends  # recorded in layer order
        fake_cuda.log.clear()
        for layer in range(LAYERS):
            load.wait_layer(layer)
        waits = [e for e in fake_cuda.log if isinstance(e, tuple) and e[0] == "wait"]
        # no host wait: the compute stream waits for each layer's own group end event
        assert waits == [("wait", fake_cuda.compute, end) for end in ends]
        await load
        assert all(torch.equal(t[torch.from_numpy(src)], t[torch.from_numpy(dst)]) for t in caches)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_refused_layer_fails_the_load_before_any_wait(fake_cuda: FakeCuda) -> None:
    lib = FakeDriverLib(fail_at=0, fail_call=2)  # call 0: the store; 1, 2, 3: the layers
    mgr, _ = _manager(fake_cuda, lib)
    async with mgr:
        keys = _keys(4)
        await _stored(mgr, keys)
        load = mgr.load_layerwise(keys, np.asarray(mgr.allocate("b", 4)), layers=2)
        assert load.batches.handles[1].refused is not None
        fake_cuda.log.clear()
        with pytest.raises(LayerLoadError):
            load.wait_layer(0)  # layer 0 copied fine, but the load is failed as a whole
        assert not any(isinstance(e, tuple) and e[0] == "wait" for e in fake_cuda.log)
        with pytest.raises(LayerLoadError):
            await load
        check_invariants(mgr)
        assert mgr.peek(keys) == 4


def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``condition`` (set by a completion thread) until it holds or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def _group_records(log: list, h2d: object, compute: object) -> list[tuple[str, object]]:
    """``("batch", stream handle)`` and ``("record", stream)`` of the copy stream's events, in order."""
    out = []
    for e in log:
        if isinstance(e, dict) and "batch" in e:
            out.append(("batch", e["stream"]))
        elif isinstance(e, tuple) and e[0] == "record" and e[2] is not compute:
            out.append(("record", e[2]))  # (the compute fence is recorded on the compute stream)
    return out


@pytest.mark.asyncio
async def test_pooled_events_each_group_bracketed_on_the_load_stream_in_order(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the event pool on (as with torch's real events): every group's copy is followed by
    its own end record on the load stream (its fence, on the compute stream, is its start),
    group 0 first; a resolved load's pairs go back to the pool (the last one once the next batch
    of the stream was timed with its end) and the next load's groups re-record them, so a resolved handle's
    ``end_event`` is no longer its own (why the GPU test reads end times with fresh events
    only), and ``wait_layer`` on a resolved group never waits on such a recycled event."""
    monkeypatch.setattr(streams, "_real_cuda_events", lambda: True)
    mgr, caches = _manager(fake_cuda, FakeDriverLib())
    async with mgr:
        keys = _keys(4)
        src = await _stored(mgr, keys)
        dst = np.asarray(mgr.allocate("b", 4))
        h2d = mgr.engine.stream(Direction.H2D)  # type: ignore[attr-defined]
        pool = mgr.engine._streams._pools[Direction.H2D]  # type: ignore[attr-defined]
        gates = [threading.Event() for _ in range(LAYERS)]
        fake_cuda.gates[:] = gates  # the first load's groups run until their gates are set
        first = mgr.load_layerwise(keys, dst, layers=2)
        first_ends = [h.end_event for h in first.batches.handles]
        assert len(set(map(id, first_ends))) == LAYERS  # none ended yet: three fresh pairs
        for gate in gates:
            gate.set()
        await first
        # back after the futures resolved, but the last: held until the next batch's timing
        assert _until(lambda: len(pool) == LAYERS - 1)
        fake_cuda.log.clear()
        second = mgr.load_layerwise(keys, dst, layers=2)
        ends = [h.end_event for h in second.batches.handles]
        # recycled pairs (a group may even reuse one of the same load's, ended meanwhile); one
        # may be new (the held pair comes back once the second load's first group was timed)
        assert len(set(map(id, ends)) & set(map(id, first_ends))) >= LAYERS - 1
        # per group: the driver's batch, then the end record, both on the load stream
        expected = [("batch", h2d.cuda_stream), ("record", h2d)] * LAYERS
        assert _group_records(fake_cuda.log, h2d, fake_cuda.compute) == expected
        records = [e[1] for e in fake_cuda.log if isinstance(e, tuple) and e[0] == "record"]
        assert [r for r in records if r in ends] == ends  # end events in layer order
        await second
        fake_cuda.log.clear()
        for layer in range(LAYERS):
            first.wait_layer(layer)  # resolved: its events now mark the second load's groups
        assert not any(isinstance(e, tuple) and e[0] == "wait" for e in fake_cuda.log)
        assert all(torch.equal(t[torch.from_numpy(src)], t[torch.from_numpy(dst)]) for t in caches)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_wait_and_save_inside_a_capture_raise(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither call is capturable: inside a capture both raise ``LayerOrderError`` and issue
    nothing; outside it the same calls go on."""
    mgr, _ = _manager(fake_cuda, FakeDriverLib())
    async with mgr:
        keys = _keys(4)
        src = await _stored(mgr, keys)
        load = mgr.load_layerwise(keys, np.asarray(mgr.allocate("b", 4)), layers=2)
        store = mgr.store_layerwise(src, _keys(8)[4:], layers=2)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        fake_cuda.log.clear()
        with pytest.raises(LayerOrderError):
            load.wait_layer(0)
        with pytest.raises(LayerOrderError):
            store.save_layer(0)
        assert not any(isinstance(e, tuple) and e[0] == "wait" for e in fake_cuda.log)
        assert store.layers_saved == 0
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        for layer in range(LAYERS):
            load.wait_layer(layer)
            store.save_layer(layer)
        await load
        await store
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_load_into_an_open_layerwise_stores_blocks_never_runs_early(
    fake_cuda: FakeCuda,
) -> None:
    """A store that saved layer 0 only still reads its blocks in the later groups: a load into
    them must not be fenced on layer 0's event alone (it would overwrite KV not yet stored)."""
    lib = FakeDriverLib()
    mgr, caches = _manager(fake_cuda, lib)
    async with mgr:
        old = _keys(8)[4:]
        await _stored(mgr, old)
        src = np.asarray(mgr.allocate("s", 4))
        expected = [t[torch.from_numpy(src)].clone() for t in caches]
        keys = _keys(4)
        store = mgr.store_layerwise(src, keys, layers=2)
        store.save_layer(0)
        assert store.batches.handle.end_event is None  # no event for the whole store yet
        load = mgr.load_many(old, src)  # into the blocks the store has yet to read
        await mgr.step()  # refused (typed), not run early, and the step itself does not raise
        with pytest.raises(TransferError, match="layerwise store"):
            await load
        for layer in range(1, LAYERS):
            store.save_layer(layer)
        await store
        check_invariants(mgr)
        dst = np.asarray(mgr.allocate("d", 4))
        back = mgr.load_many(keys, dst)
        await mgr.step()
        await back
        for t, want in zip(caches, expected):
            assert torch.equal(t[torch.from_numpy(dst)], want)  # the store kept the old KV
