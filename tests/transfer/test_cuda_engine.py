"""Tests of the CUDA engine: driver resolution, call paths, ordering, completion, failures.

Without a GPU the driver entry points are ctypes callbacks that really copy host memory and log
their arguments, and ``torch.cuda`` streams/events are fakes that log the order of operations;
``gpu``-marked tests run the real thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib, hold_two_tables

from kvmgr.errors import (
    ClosedError,
    ConfigError,
    GeometryError,
    TransferError,
    TransferTimeoutError,
)
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import driver as copy_driver
from kvmgr.transfer import pinned
from kvmgr.transfer.cuda_current import DriverEvents
from kvmgr.transfer.cuda_engine import CudaBatchEngine
from kvmgr.transfer.driver import CopyDriver, MemcpyAttributes
from kvmgr.transfer.driver_call import native_call
from kvmgr.transfer.pinned import HostRegistrar, PinnedHostBuffer, mapped_device_pointer
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan

HAS_CUDA = torch.cuda.is_available()


def _host_kv(
    rng: np.random.Generator, num_tensors: int, num_blocks: int, page: int
) -> list[torch.Tensor]:
    data = rng.integers(0, 256, (num_tensors, num_blocks, page), dtype=np.uint8)
    return list(torch.from_numpy(data).unbind(0))


def _pages(tensors: list[torch.Tensor], ids: Any) -> torch.Tensor:
    # np.array copies: torch rejects numpy views with negative strides (ids[::-1]).
    index = torch.as_tensor(np.array(ids, dtype=np.int64), device=tensors[0].device)
    return torch.stack([t[index].cpu() for t in tensors])


def _poisoned_pair(
    rng: np.random.Generator, page: int, num_tensors: int = 3
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    src = _host_kv(rng, num_tensors, 24, page)
    dst = [torch.full((30, page), 0xA5, dtype=torch.uint8) for _ in range(num_tensors)]
    return src, dst


# ------------------------------------------------------------------ resolution and decisions


@pytest.mark.parametrize(
    ("driver_version", "granted", "expected", "asked"),
    [
        (13000, (12080, 13000), 13000, [13000]),
        (13020, (12080,), 12080, [13000, 12080]),  # 13.x driver without the 13.0 form
        (12090, (12080, 13000), 12080, [12080]),  # never asks above the driver's version
        (12080, (12080,), 12080, [12080]),
        (12060, (12080, 13000), None, []),  # too old: nothing requested
    ],
)
def test_resolve_batch_abi(
    driver_version: int, granted: tuple[int, ...], expected: int | None, asked: list[int]
) -> None:
    lib = FakeDriverLib()
    found = copy_driver.resolve_batch_abi(driver_version, lib.resolver(granted))
    assert (found[0] if found else None) == expected
    assert [c["resolve"][1] for c in lib.calls] == asked
    if found:
        assert found[1] == ctypes.cast(lib._callbacks[expected], ctypes.c_void_p).value


@pytest.mark.parametrize(
    ("requested", "abi", "stream", "expected"),
    [
        ("batch", 13000, 0x7F00, "batch"),
        ("batch", 12080, 0x7F00, "batch"),
        ("batch", 13000, 0, "loop"),  # legacy default stream: never batch
        ("batch", 13000, 1, "loop"),  # CU_STREAM_LEGACY
        ("batch", None, 0x7F00, "loop"),  # entry point missing
        ("loop", 13000, 0x7F00, "loop"),
    ],
)
def test_batch_or_loop(requested: str, abi: int | None, stream: int, expected: str) -> None:
    assert copy_driver.batch_or_loop(requested, abi, stream) == expected


def test_access_order_is_stream_for_stores_and_any_only_for_loads() -> None:
    assert copy_driver.access_order(Direction.D2H) == copy_driver.SRC_ACCESS_ORDER_STREAM == 1
    assert copy_driver.access_order(Direction.H2D) == copy_driver.SRC_ACCESS_ORDER_ANY == 3


def test_attrs_struct_matches_cuda_python_bytes() -> None:
    pytest.importorskip("cuda.bindings.driver")
    assert ctypes.sizeof(MemcpyAttributes) == 24
    assert copy_driver.attrs_layout_matches() is True


# ------------------------------------------------------------------ call paths, host memory


@pytest.mark.parametrize("abi", [12080, 13000])
@pytest.mark.parametrize("page", [4096, 1152, 584])
def test_batch_ctypes_passes_numpy_buffers_and_one_attribute(abi: int, page: int) -> None:
    rng = np.random.default_rng(page + abi)
    src, dst = _poisoned_pair(rng, page)
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver((abi,)), driver_version=13000)
    assert driver.batch_abi == abi
    src_ids, dst_ids = np.array([5, 6, 7, 19, 0]), np.array([11, 12, 13, 2, 29])
    plan = build_plan(
        Direction.D2H, KVLayout.from_tensors(src), KVLayout.from_tensors(dst), src_ids, dst_ids
    )
    assert plan.num_descriptors == 3 * 3  # the run 5,6,7 -> 11,12,13 merged in each tensor
    path = driver.copy("batch", plan.dst_addrs, plan.src_addrs, plan.sizes, 0x7F00, 1)
    assert path == "batch"
    (call,) = [c for c in lib.calls if "batch" in c]
    assert call == {
        "batch": abi,
        "count": 9,
        "order": 1,
        "stream": 0x7F00,
        "idxs": [0],
        "num_attrs": 1,
    }
    assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))
    untouched = np.setdiff1d(np.arange(30), dst_ids)
    assert bool((_pages(dst, untouched) == 0xA5).all())


def test_batch_failure_reports_fail_index_on_12080_only() -> None:
    for abi, expected in ((12080, 4), (13000, None)):
        lib = FakeDriverLib(fail_at=4)
        driver = CopyDriver(lib.resolver((abi,)), driver_version=13000)
        addrs = np.arange(8, dtype=np.int64) * 64 + 4096
        with pytest.raises(TransferError, match="cuMemcpyBatchAsync") as info:
            driver.copy("batch", addrs, addrs, np.full(8, 16), 0x7F00, 3)
        assert info.value.fail_index == expected


def test_default_stream_falls_back_to_the_loop_and_never_calls_batch() -> None:
    rng = np.random.default_rng(7)
    src, dst = _poisoned_pair(rng, 584)
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver(), driver_version=13000)
    plan = build_plan(
        Direction.H2D, KVLayout.from_tensors(src), KVLayout.from_tensors(dst), [1, 9, 3], [4, 0, 22]
    )
    assert driver.copy("batch", plan.dst_addrs, plan.src_addrs, plan.sizes, 0, 3) == "loop"
    assert not any("batch" in c for c in lib.calls)
    assert sum("loop" in c for c in lib.calls) == plan.num_descriptors
    assert torch.equal(_pages(dst, [4, 0, 22]), _pages(src, [1, 9, 3]))


def test_loop_failure_names_the_copy_and_keeps_earlier_copies() -> None:
    rng = np.random.default_rng(3)
    src, dst = _poisoned_pair(rng, 1152, num_tensors=1)
    lib = FakeDriverLib(fail_at=2)  # keeps its ctypes callbacks alive while the driver calls them
    driver = CopyDriver(lib.resolver(), driver_version=12080)
    plan = build_plan(
        Direction.D2H,
        KVLayout.from_tensors(src),
        KVLayout.from_tensors(dst),
        [8, 2, 15, 4],
        [1, 3, 5, 7],
        merge=False,
    )
    with pytest.raises(TransferError, match="copy 2") as info:
        driver.loop(plan.dst_addrs, plan.src_addrs, plan.sizes, 0x7F00)
    assert info.value.fail_index == 2
    assert torch.equal(_pages(dst, [1, 3]), _pages(src, [8, 2]))  # unmerged plans keep the order
    assert bool((_pages(dst, [5, 7]) == 0xA5).all())


def test_batch_lists_builds_cuda_python_arguments() -> None:
    cu = pytest.importorskip("cuda.bindings.driver")
    seen: dict[str, Any] = {}

    def fake_batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream):  # type: ignore[no-untyped-def]
        seen.update(types={type(x) for x in dsts + srcs}, count=count, order=attrs[0].srcAccessOrder,
                    idxs=idxs, num_attrs=num_attrs, stream=stream, sizes=sizes)  # fmt: skip
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE, 1)  # the 12.x binding shape

    binding = type("Binding", (), {"CUdeviceptr": cu.CUdeviceptr, "CUmemcpyAttributes": cu.CUmemcpyAttributes,
                                   "CUmemcpySrcAccessOrder": cu.CUmemcpySrcAccessOrder,
                                   "cuMemcpyBatchAsync": staticmethod(fake_batch)})  # fmt: skip
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver(), driver_version=13000, binding=binding)
    with pytest.raises(TransferError, match="CUDA_ERROR_INVALID_VALUE") as info:
        driver.copy(
            "batch",
            np.array([64, 128]),
            np.array([256, 512]),
            np.array([8, 24]),
            0x7F00,
            1,
            call="lists",
        )
    assert info.value.fail_index == 1
    assert seen["types"] == {cu.CUdeviceptr} and seen["count"] == 2 and seen["sizes"] == [8, 24]
    assert int(seen["order"]) == 1 and seen["idxs"] == [0] and seen["num_attrs"] == 1
    assert seen["stream"] == 0x7F00


# ------------------------------------------------------------------ pinned memory


def test_pinned_buffer_registers_whole_pages_once_and_unregisters_on_close() -> None:
    log: list[tuple[str, int, int]] = []
    registrar = HostRegistrar(
        lambda a, n: log.append(("reg", a, n)), lambda a: log.append(("unreg", a, 0))
    )
    buffer = PinnedHostBuffer(10_000, registrar=registrar)
    ((_, address, size),) = log
    assert address % 4096 == 0 and size == 12288 and buffer.is_registered
    assert buffer.tensor.numel() == 10_000 and buffer.tensor.data_ptr() == address
    buffer.close()
    buffer.close()
    assert log[1:] == [("unreg", address, 0)]


def _refusing_registrar() -> HostRegistrar:
    def refuse(address: int, size: int) -> None:
        raise RuntimeError("cudaHostRegister failed: out of memory (error 2)")

    return HostRegistrar(refuse, lambda a: None)


def test_pinned_registration_failure_raises_or_falls_back_when_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(TransferError, match="allow_pageable=True"):
        PinnedHostBuffer(4096, registrar=_refusing_registrar())
    with caplog.at_level("WARNING"):
        buffer = PinnedHostBuffer(4096, allow_pageable=True, registrar=_refusing_registrar())
    assert not buffer.is_registered and "pageable" in caplog.text
    with pytest.raises(ValueError, match="num_bytes"):
        PinnedHostBuffer(0)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without a driver")
def test_mapped_device_pointer_needs_a_driver() -> None:
    pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(RuntimeError):
        mapped_device_pointer(torch.empty(64, dtype=torch.uint8).data_ptr())


# ------------------------------------------------------------------ info without a driver


def test_collect_info_never_raises() -> None:
    from kvmgr.transfer.info import collect_info

    info = collect_info()
    for key in (
        "torch",
        "cuda_python",
        "gpu",
        "driver",
        "driver_cuda",
        "batch_copy_abi",
        "pinned_memory",
        "copy_path",
    ):
        assert info[key] not in (None, "")
    if not HAS_CUDA:
        assert info["gpu"] == "no CUDA device" and info["copy_path"] == "host only"
    else:
        assert info["batch_copy_abi"] in (12080, 13000) and str(info["pinned_memory"]).startswith(
            "ok"
        )


# ------------------------------------------------------------------ the engine, on fake CUDA


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def _fake_engine(
    fake: FakeCuda,
    lib: FakeDriverLib | None = None,
    versions: tuple[int, ...] = (12080, 13000),
    driver_version: int = 13000,
    **kwargs: Any,
) -> tuple[CudaBatchEngine, FakeDriverLib]:
    lib = lib or FakeDriverLib()
    driver = CopyDriver(lib.resolver(versions), driver_version=driver_version)
    driver.fake_lib = lib  # type: ignore[attr-defined]  # its ctypes callbacks must outlive calls
    lib.calls = fake.log  # driver calls interleave with stream/event operations from now on
    return CudaBatchEngine(driver=driver, **kwargs), lib


def _store_plan(
    rng: np.random.Generator, page: int, num_blocks: int, num_tensors: int = 2
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], np.ndarray, np.ndarray]:
    src, dst = _host_kv(rng, num_tensors, 40, page), _host_kv(rng, num_tensors, 40, page)
    src_ids = rng.choice(20, num_blocks, replace=False) * 2  # never adjacent: nothing merges
    dst_ids = rng.choice(40, num_blocks, replace=False)
    plan = build_plan(
        Direction.D2H, KVLayout.from_tensors(src), KVLayout.from_tensors(dst), src_ids, dst_ids
    )
    return plan, src, dst, src_ids, dst_ids


def test_a_submit_on_another_device_runs_under_its_device_guard_and_the_current_one_enters_none(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(13)
    guards: list[Any] = []

    @contextlib.contextmanager
    def guard(device: Any) -> Any:
        guards.append(torch.device(device))
        fake_cuda.log.append(("enter", device, None))
        yield
        fake_cuda.log.append(("exit", device, None))

    monkeypatch.setattr(torch.cuda, "device", guard)  # the current device stays 0
    for index, expected in ((1, [torch.device("cuda", 1)]), (0, [])):
        guards.clear()
        engine, _ = _fake_engine(fake_cuda, device=f"cuda:{index}")
        with engine:
            plan, src, dst, src_ids, dst_ids = _store_plan(rng, 584, 4)
            fake_cuda.log.clear()
            handle = engine.submit(plan)
            ops = [e[0] if isinstance(e, tuple) else "batch" for e in fake_cuda.log]
            handle.future.result(timeout=5)
        inner = ["record", "wait", "batch", "record"]  # fence, wait, copy, end (no start event)
        assert guards == expected
        assert ops == (["enter", *inner, "exit"] if expected else inner)
        for s_t, d_t in zip(src, dst):
            assert torch.equal(d_t[dst_ids], s_t[src_ids])


def test_malformed_plans_are_refused_before_anything_is_enqueued(fake_cuda: FakeCuda) -> None:
    rng = np.random.default_rng(14)
    engine, _ = _fake_engine(fake_cuda)
    with engine:
        plan, *_ = _store_plan(rng, 584, 3)
        a = np.array([1, 2], dtype=np.int64)
        bad = [
            (ValueError, object()),
            (ValueError, attrs.evolve(plan, direction="d2h")),  # from build_plan, not a Direction
            (ValueError, TransferPlan(Direction.D2H, a, a, a[:1])),  # unequal arrays
            (GeometryError, TransferPlan(Direction.D2H, a, a, np.array([4, -1], dtype=np.int64))),
        ]
        fake_cuda.log.clear()
        for error, plan_ in bad:
            with pytest.raises(error):
                engine.submit(plan_)
        assert fake_cuda.log == [] and engine.statistics().batches_submitted == 0
        assert engine.submit(plan).batch_id == 0  # no id was taken by a refused plan


def test_submit_fences_on_compute_and_dependencies_then_copies_between_events(
    fake_cuda: FakeCuda,
) -> None:
    rng = np.random.default_rng(11)
    engine, _ = _fake_engine(fake_cuda)
    with engine:
        # a store, then a load that must wait for it
        store, src, dst, src_ids, dst_ids = _store_plan(rng, 584, 5)
        first = engine.submit(store)
        load = build_plan(
            Direction.H2D,
            KVLayout.from_tensors(dst),
            KVLayout.from_tensors(src),
            dst_ids[:2],
            [1, 3],
        )
        fake_cuda.log.clear()
        second = engine.submit(load, wait_for=[first])
        h2d = engine.stream(Direction.H2D)
        ops = [
            (e[0], e[2]) if isinstance(e, tuple) else ("batch", e["stream"], e["order"])
            for e in fake_cuda.log
        ]
        fence = fake_cuda.log[0][1]
        assert ops == [
            ("record", fake_cuda.compute),  # fence recorded on the compute stream
            ("wait", fence),  # the copy stream waits on it (rule 4)
            ("wait", first.end_event),  # and on the store it depends on
            ("record", h2d),  # start event
            ("batch", h2d.cuda_stream, 3),  # ANY only for H2D (rule 3)
            ("record", h2d),  # end event
        ]
        assert fake_cuda.log[-1][1] is second.end_event and fake_cuda.log[1][0:2] == ("wait", h2d)
        result = first.future.result(timeout=5)
        assert (result.path, result.num_bytes, result.device_s) == (
            "batch",
            store.num_bytes,
            0.0005,
        )
        assert second.future.result(timeout=5).num_descriptors == load.num_descriptors
        assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))
        assert engine.stream(Direction.H2D).priority < engine.stream(Direction.D2H).priority
        stats = engine.statistics()
    assert (stats.batches_completed, stats.bytes_d2h, stats.bytes_h2d) == (
        2,
        store.num_bytes,
        load.num_bytes,
    )
    assert (stats.path, stats.batch_abi, stats.in_flight, stats.host_memory) == (
        "batch",
        13000,
        0,
        "none",
    )
    # host time: the driver calls (the fake's memmoves) are part of each submit's time
    assert 0 < stats.issue_s < stats.submit_s


def test_splits_above_the_cap_and_offsets_the_fail_index(fake_cuda: FakeCuda) -> None:
    rng = np.random.default_rng(12)
    engine, _ = _fake_engine(fake_cuda, max_descriptors=4)
    with engine:
        plan, src, dst, src_ids, dst_ids = _store_plan(rng, 1152, 6)  # 12 descriptors
        fake_cuda.log.clear()
        assert engine.submit(plan).future.result(timeout=5).num_descriptors == 12
        assert [e["count"] for e in fake_cuda.log if isinstance(e, dict)] == [4, 4, 4]
        assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))
        assert engine.statistics().chunks_submitted == 3
    # 12.8 ABI, second chunk refused at its index 2: the plan's descriptor 4 + 2
    failing = FakeDriverLib(fail_at=2, fail_call=1)
    engine, _ = _fake_engine(fake_cuda, failing, versions=(12080,), max_descriptors=4)
    with engine:
        plan, *_ = _store_plan(rng, 4096, 6)
        handle = engine.submit(plan)
        with pytest.raises(TransferError, match="batch 0") as info:
            handle.future.result(timeout=5)
        assert info.value.fail_index == 6 and failing.num_batch_calls == 2
        # the engine stays usable: the next batch copies and completes
        plan2, src, dst, src_ids, dst_ids = _store_plan(rng, 4096, 1)
        assert engine.submit(plan2).future.result(timeout=5).num_bytes == plan2.num_bytes
        assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))
        stats = engine.statistics()
    assert (stats.batches_failed, stats.batches_completed, stats.in_flight) == (1, 1, 0)


def test_completion_is_fifo_per_direction_and_independent_across(fake_cuda: FakeCuda) -> None:
    rng = np.random.default_rng(13)
    engine, _ = _fake_engine(fake_cuda)
    with engine:
        gate = fake_cuda.gate()
        done: list[int] = []
        plan, *_ = _store_plan(rng, 584, 2)
        stores = [engine.submit(plan), engine.submit(plan)]  # the first one is held by the gate
        load = engine.submit(
            build_plan(
                Direction.H2D, *[KVLayout.from_tensors(_host_kv(rng, 1, 8, 64))] * 2, [1], [2]
            )
        )
        for h in stores:
            h.future.add_done_callback(lambda f, i=h.batch_id: done.append(i))
        load.future.result(timeout=5)  # the other direction is not held up
        assert not stores[0].done() and not stores[1].done()
        gate.set()
        assert [h.future.result(timeout=5).batch_id for h in stores] == [0, 1]
    assert done == [0, 1]


def test_plan_arrays_stay_alive_until_the_end_event(fake_cuda: FakeCuda) -> None:
    import weakref

    rng = np.random.default_rng(17)
    with _fake_engine(fake_cuda)[0] as engine:
        plan, *_ = _store_plan(rng, 584, 3)
        gate = fake_cuda.gate()
        handle = engine.submit(plan)
        alive = weakref.ref(plan)
        del plan
        gc.collect()
        assert alive() is not None  # the batch has not ended: the engine still holds it (rule 7)
        gate.set()
        handle.future.result(timeout=5)
        gc.collect()
        assert alive() is None


def test_descriptor_buffer_lives_until_the_end_event_then_is_reused(fake_cuda: FakeCuda) -> None:
    rng = np.random.default_rng(23)
    with _fake_engine(fake_cuda)[0] as engine:
        buffers = engine.issuer.buffers
        plan, *_ = _store_plan(rng, 584, 3)
        hold_two_tables(fake_cuda, engine, buffers, plan)
        assert plan._built is None  # the plan's own descriptor arrays were never built
        # both ended: their tables are back, and the next batch allocates none
        plan, src, dst, src_ids, dst_ids = _store_plan(rng, 584, 4)
        engine.submit(plan).future.result(timeout=5)
        assert buffers.num_allocated == 2
        assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))
        # a hand-made plan (the same descriptors) is copied from its own arrays, no buffer
        plan, src, dst, src_ids, dst_ids = _store_plan(rng, 584, 2)
        hand = TransferPlan(Direction.D2H, plan.src_addrs, plan.dst_addrs, plan.sizes)
        engine.submit(hand).future.result(timeout=5)
        assert buffers.num_allocated == 2
        assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))


def test_close_waits_times_out_and_is_idempotent(fake_cuda: FakeCuda) -> None:
    rng = np.random.default_rng(14)
    engine, _ = _fake_engine(fake_cuda)
    gate = fake_cuda.gate()
    plan, *_ = _store_plan(rng, 584, 1)
    handle = engine.submit(plan)
    with pytest.raises(TransferTimeoutError, match="in flight"):
        engine.close(timeout_s=0.05)
    with pytest.raises(ClosedError):
        engine.submit(plan)
    gate.set()
    engine.close()
    engine.close()
    assert handle.future.result(timeout=0).num_bytes == plan.num_bytes


def test_a_cancelled_future_does_not_stop_completion(fake_cuda: FakeCuda) -> None:
    rng = np.random.default_rng(15)
    with _fake_engine(fake_cuda)[0] as engine:
        gate = fake_cuda.gate()
        plan, *_ = _store_plan(rng, 584, 1)
        first = engine.submit(plan)
        assert first.future.cancel()
        second = engine.submit(plan)
        gate.set()
        assert second.future.result(timeout=5).batch_id == 1
    assert engine.statistics().batches_completed == 2


def test_unclosed_engine_warns(fake_cuda: FakeCuda) -> None:
    engine, _ = _fake_engine(fake_cuda)
    with pytest.warns(ResourceWarning, match="not closed"):
        del engine
        gc.collect()


def test_batch_path_needs_the_entry_point_and_auto_falls_back_to_the_loop(
    fake_cuda: FakeCuda,
) -> None:
    with pytest.raises(TransferError, match="cuMemcpyBatchAsync"):
        _fake_engine(fake_cuda, driver_version=12060, copy_path="batch")
    rng = np.random.default_rng(16)
    with _fake_engine(fake_cuda, driver_version=12060)[0] as engine:
        plan, src, dst, src_ids, dst_ids = _store_plan(rng, 584, 3)
        assert engine.submit(plan).future.result(timeout=5).path == "loop"
        assert torch.equal(_pages(dst, dst_ids), _pages(src, src_ids))
    assert (engine.statistics().path, engine.statistics().batch_abi) == ("loop", None)


@pytest.mark.skipif(HAS_CUDA, reason="registration really works where CUDA is present")
def test_pageable_fallback_shows_in_statistics(fake_cuda: FakeCuda) -> None:
    with _fake_engine(fake_cuda)[0] as engine, pytest.raises(TransferError, match="page-lock"):
        engine.allocate_host(8192)
    with _fake_engine(fake_cuda, allow_pageable=True)[0] as engine:
        assert engine.allocate_host(8192).numel() == 8192
        assert engine.statistics().host_memory == "pageable"
    with pytest.raises(ClosedError):
        engine.allocate_host(8192)


def test_host_memory_is_the_engines_record_and_survives_close(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.Tensor.is_pinned() says False for registered memory (torch 2.11): the engine reports
    # what the registration returned, also after close() has unregistered it.
    log: list[tuple[str, int]] = []
    registrar = HostRegistrar(
        lambda a, n: log.append(("reg", a)), lambda a: log.append(("unreg", a))
    )
    monkeypatch.setattr(pinned, "torch_registrar", lambda: registrar)
    engine, _ = _fake_engine(fake_cuda)
    with engine:
        assert engine.statistics().host_memory == "none"
        first, second = engine.allocate_host(5000), engine.allocate_host(8192)
        assert engine.statistics().host_memory == "pinned"
    assert [kind for kind, _ in log] == ["reg", "reg", "unreg", "unreg"]
    assert {a for _, a in log} == {first.data_ptr(), second.data_ptr()}
    assert engine.statistics().host_memory == "pinned"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"copy_path": "fast"}, "copy_path"),
        ({"batch_call": "cffi"}, "batch_call"),
        ({"h2d_priority": "urgent"}, "h2d_priority"),
        ({"max_descriptors": 0}, "max_descriptors"),
        ({"max_descriptors": True}, "max_descriptors"),
    ],
)
def test_constructor_rejects_bad_arguments_before_touching_cuda(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        CudaBatchEngine(**kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message without a GPU")
def test_engine_without_a_gpu_raises_a_clear_error() -> None:
    with pytest.raises(TransferError, match="needs a CUDA device"):
        CudaBatchEngine()


# ------------------------------------------------------------------ GPU


def _gpu_kv(seed: int, num_tensors: int, num_blocks: int, page: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device="cuda", generator=gen)
        for _ in range(num_tensors)
    ]


def _pinned_kv(
    engine: CudaBatchEngine, seed: int, num_tensors: int, num_blocks: int, page: int
) -> list[torch.Tensor]:
    flat = engine.allocate_host(num_tensors * num_blocks * page)
    gen = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
    return list(flat.view(num_tensors, num_blocks, page).unbind(0))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [4096, 32768, 1152, 584])
@pytest.mark.parametrize(
    ("copy_path", "batch_call"), [("batch", "ctypes"), ("batch", "lists"), ("loop", "ctypes")]
)
def test_gpu_round_trip_random_pages(page: int, copy_path: str, batch_call: str) -> None:
    with CudaBatchEngine(copy_path=copy_path, batch_call=batch_call) as engine:
        gpu, host = _gpu_kv(page, 3, 40, page), _pinned_kv(engine, page, 3, 50, page)
        # not host[0].is_pinned(): torch 2.11 says False for cudaHostRegister-ed memory
        assert engine.statistics().host_memory == "pinned"
        assert mapped_device_pointer(host[0].data_ptr()) == host[0].data_ptr()
        gpu_layout, host_layout = KVLayout.from_tensors(gpu), KVLayout.from_tensors(host)
        # store: a run of four blocks (merged) and three scattered ones
        gpu_ids, cpu_ids = [3, 4, 5, 6, 17, 30, 2], [10, 11, 12, 13, 40, 0, 25]
        store = build_plan(Direction.D2H, gpu_layout, host_layout, gpu_ids, cpu_ids)
        assert store.num_descriptors == 3 * 4 < store.num_pages
        result = engine.submit(store).future.result(timeout=60)
        assert (result.path, result.num_bytes) == (copy_path, 7 * 3 * page) and result.device_s > 0
        assert torch.equal(_pages(host, cpu_ids), _pages(gpu, gpu_ids))
        # load them back into other GPU blocks, poisoned first
        back = [20, 21, 22, 23, 0, 39, 8]
        for t in gpu:
            t[torch.tensor(back, device="cuda")] = 0xEE
        load = engine.submit(build_plan(Direction.H2D, host_layout, gpu_layout, cpu_ids, back))
        engine.stream_wait(load)
        assert torch.equal(_pages(gpu, back), _pages(host, cpu_ids))
        assert load.future.result(timeout=60).path == copy_path
        stats = engine.statistics()
    assert (stats.bytes_d2h, stats.bytes_h2d, stats.batches_failed) == (7 * 3 * page,) * 2 + (0,)
    assert stats.path == copy_path and stats.device_s_d2h > 0


@pytest.mark.gpu
def test_gpu_registered_memory_is_mapped_until_close() -> None:
    buffer = PinnedHostBuffer(3 * 4096 + 100)
    start, inside = buffer.tensor.data_ptr(), buffer.tensor[3 * 4096 :].data_ptr()
    assert buffer.is_registered and buffer.register_s > 0
    assert mapped_device_pointer(start) == start and mapped_device_pointer(inside) == inside
    buffer.close()
    assert not buffer.is_registered
    if not _pageable_memory_access():  # with HMM the driver may map any host page
        pageable = torch.empty(1 << 20, dtype=torch.uint8)
        assert mapped_device_pointer(pageable.data_ptr()) is None
        assert mapped_device_pointer(start) is None  # unregistered by close()


def _pageable_memory_access() -> bool:
    from cuda.bindings import driver as cu

    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS
    err, value = cu.cuDeviceGetAttribute(attribute, cu.CUdevice(torch.cuda.current_device()))
    return err != cu.CUresult.CUDA_SUCCESS or bool(value)


@pytest.mark.gpu
def test_gpu_splitting_above_the_cap() -> None:
    with CudaBatchEngine(copy_path="batch", max_descriptors=5) as engine:
        gpu, host = _gpu_kv(1, 3, 64, 4096), _pinned_kv(engine, 1, 3, 64, 4096)
        ids = np.random.default_rng(1).choice(32, 13, replace=False) * 2
        plan = build_plan(
            Direction.D2H, KVLayout.from_tensors(gpu), KVLayout.from_tensors(host), ids, ids[::-1]
        )
        assert plan.num_descriptors == 39
        assert engine.submit(plan).future.result(timeout=60).num_descriptors == 39
        assert torch.equal(_pages(host, ids[::-1]), _pages(gpu, ids))
        assert engine.statistics().chunks_submitted == 8


@pytest.mark.gpu
def test_gpu_default_stream_uses_the_loop() -> None:
    driver = CopyDriver()
    assert driver.batch_abi in (12080, 13000)
    gpu = _gpu_kv(2, 2, 16, 1152)
    host = [torch.full((16, 1152), 0xA5, dtype=torch.uint8).pin_memory() for _ in range(2)]
    plan = build_plan(
        Direction.D2H,
        KVLayout.from_tensors(gpu),
        KVLayout.from_tensors(host),
        [1, 7, 9],
        [0, 4, 15],
    )
    torch.cuda.synchronize()
    assert driver.copy("batch", plan.dst_addrs, plan.src_addrs, plan.sizes, 0, 1) == "loop"
    torch.cuda.synchronize()
    assert torch.equal(_pages(host, [0, 4, 15]), _pages(gpu, [1, 7, 9]))


@pytest.mark.gpu
def test_gpu_store_right_after_a_kernel_sees_the_final_bytes() -> None:
    with CudaBatchEngine() as engine:
        gpu, host = _gpu_kv(3, 4, 32, 32768), _pinned_kv(engine, 3, 4, 32, 32768)
        ids = np.array([2, 9, 10, 31])
        ids_gpu = torch.from_numpy(ids).cuda()
        torch.cuda.synchronize()
        # round 0: torch makes the fence and the pooled events; later rounds record and wait
        # on them through the driver's entry points where the C call builds (DriverEvents)
        for value in (0x3C, 0x5A, 0x77):
            # keep the compute stream busy (~50 ms), then the kernel writing the blocks
            torch.cuda._sleep(100_000_000)
            for t in gpu:
                t.index_fill_(0, ids_gpu, value)
            handle = engine.submit(
                build_plan(
                    Direction.D2H,
                    KVLayout.from_tensors(gpu),
                    KVLayout.from_tensors(host),
                    ids,
                    [0, 1, 5, 6],
                )
            )
            handle.future.result(timeout=60)
            assert bool((_pages(host, [0, 1, 5, 6]) == value).all())
        if native_call() is not None:
            assert isinstance(engine._streams._record.__self__, DriverEvents)


@pytest.mark.gpu
def test_gpu_load_then_a_kernel_reading_the_blocks() -> None:
    with CudaBatchEngine() as engine:
        gpu, host = _gpu_kv(4, 3, 32, 584), _pinned_kv(engine, 4, 3, 32, 584)
        dst_ids = np.array([3, 4, 20])
        dst = torch.from_numpy(dst_ids).cuda()
        for t in gpu:
            t.index_fill_(0, dst, 0xEE)
        torch.cuda.synchronize()
        # the copy starts late: a reader that does not wait for it sees 0xEE
        with torch.cuda.stream(engine.stream(Direction.H2D)):
            torch.cuda._sleep(100_000_000)
        handle = engine.submit(
            build_plan(
                Direction.H2D,
                KVLayout.from_tensors(host),
                KVLayout.from_tensors(gpu),
                [30, 1, 7],
                dst_ids,
            )
        )
        engine.stream_wait(handle)
        # the reading kernel, on the compute stream
        read = torch.stack([t[dst] for t in gpu]).clone()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(read.cpu(), _pages(host, [30, 1, 7]))
        handle.future.result(timeout=60)


@pytest.mark.gpu
def test_gpu_refused_batch_fails_its_future_and_the_engine_stays_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with CudaBatchEngine(copy_path="batch") as engine:
        gpu, host = _gpu_kv(5, 2, 16, 4096), _pinned_kv(engine, 5, 2, 16, 4096)
        layouts = KVLayout.from_tensors(gpu), KVLayout.from_tensors(host)
        # an INVALID source access order makes the driver refuse the call (CUDA_ERROR_INVALID_VALUE)
        monkeypatch.setitem(engine.issuer._orders, Direction.D2H, 0)
        bad = engine.submit(build_plan(Direction.D2H, *layouts, [1, 2], [3, 4]))
        with pytest.raises(TransferError, match="INVALID_VALUE"):
            bad.future.result(timeout=60)
        monkeypatch.setitem(
            engine.issuer._orders, Direction.D2H, copy_driver.SRC_ACCESS_ORDER_STREAM
        )
        good = engine.submit(build_plan(Direction.D2H, *layouts, [5, 9], [0, 15]))
        good.future.result(timeout=60)
        assert torch.equal(_pages(host, [0, 15]), _pages(gpu, [5, 9]))
        stats = engine.statistics()
    assert (stats.batches_failed, stats.batches_completed) == (1, 1)


@pytest.mark.gpu
def test_gpu_close_times_out_while_a_copy_runs() -> None:
    engine = CudaBatchEngine()
    gpu, host = _gpu_kv(6, 1, 8, 4096), _pinned_kv(engine, 6, 1, 8, 4096)
    with torch.cuda.stream(engine.stream(Direction.D2H)):
        torch.cuda._sleep(400_000_000)  # ~0.2 s
    handle = engine.submit(
        build_plan(Direction.D2H, KVLayout.from_tensors(gpu), KVLayout.from_tensors(host), [1], [2])
    )
    with pytest.raises(TransferTimeoutError):
        engine.close(timeout_s=0.0)
    engine.close()
    assert handle.done() and torch.equal(_pages(host, [2]), _pages(gpu, [1]))
