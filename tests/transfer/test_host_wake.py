"""``completion="host_func"`` (``kvmgr.transfer._host_wake``, issue 27, helper stepcuda7): a
batch reaches its completion thread through a host function on its copy stream (the real C
callback, fired by ``FakeHostFuncs`` once the batch's end event ended), not through a queue put
at submit. Settlement still waits for the end event; refused launches, device errors (no host
function runs) and stop are covered; the results are the queue completion's.
(``tests/transfer/test_cuda_engine.py`` runs its fake-CUDA tests under both completions.)"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Any

import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib, FakeHostFuncs

from kvmgr.errors import ConfigError, TransferError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import _host_wake
from kvmgr.transfer.cuda_engine import CudaBatchEngine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, build_plan

pytestmark = pytest.mark.skipif(
    _host_wake.wake_address() is None, reason="the C host function does not build here"
)


class FailingCuda(FakeCuda):
    """``FakeCuda`` whose end events raise at ``query`` / ``synchronize`` once ``failing``."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        fake, base = self, self.Event

        class Event(base):  # type: ignore[misc,valid-type]
            def synchronize(self) -> None:
                super().synchronize()
                if fake.failing:
                    raise RuntimeError("an illegal address was encountered")

            def query(self) -> bool:
                if fake.failing:
                    raise RuntimeError("an illegal address was encountered")
                return super().query()

        self.Event = Event


def _engine(**kwargs: Any) -> CudaBatchEngine:
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver(), driver_version=13000)
    driver.fake_lib = lib  # type: ignore[attr-defined]
    return CudaBatchEngine(driver=driver, **kwargs)


def _store(rng: np.random.Generator, n: int = 3) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], np.ndarray, np.ndarray]:  # fmt: skip
    src = [torch.randint(0, 256, (16, 64), dtype=torch.uint8) for _ in range(2)]
    dst = [torch.zeros(32, 64, dtype=torch.uint8) for _ in range(2)]
    s, d = rng.choice(16, n, replace=False), rng.choice(32, n, replace=False)
    plan = build_plan(Direction.D2H, KVLayout.from_tensors(src), KVLayout.from_tensors(dst), s, d)
    return plan, src, dst, s, d


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FailingCuda().install(monkeypatch)
    cuda.host_funcs = FakeHostFuncs(cuda).install(monkeypatch)  # type: ignore[attr-defined]
    return cuda


def test_random_batches_settle_in_order_after_their_end_with_the_queue_results(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = {}
    for completion in ("queue", "host_func"):
        rng = np.random.default_rng(5)
        with _engine(completion=completion) as engine:
            assert engine.statistics().completion == completion
            inbox = engine._streams._queues[Direction.D2H]
            gates = [fake.gate() if rng.random() < 0.5 else None for _ in range(12)]
            fake.gates = [g for g in gates if g is not None]
            batches = [_store(rng) for _ in gates]
            handles = [engine.submit(b[0]) for b in batches]
            done: list[int] = []
            for h in handles:
                h.future.add_done_callback(lambda f, i=h.batch_id, out=done: out.append(i))
            for i in rng.permutation(len(gates)):  # the device "ends" them in any order
                if gates[i] is not None:
                    time.sleep(0.002)
                    first_open = next((j for j, g in enumerate(gates) if g and not g.is_set()), 99)
                    assert all(not handles[j].done() for j in range(first_open, len(gates))
                               if gates[j] is not None)  # fmt: skip
                    gates[i].set()
            out = [h.future.result(timeout=5) for h in handles]
            assert done == sorted(done)  # FIFO
            for _, src, dst, s, d in batches:  # (each batch copied into its own dst)
                for a, b in zip(src, dst):
                    assert torch.equal(a[s], b[d])
            results[completion] = [
                (r.batch_id, r.num_bytes, r.num_descriptors, r.path) for r in out
            ]
    assert results["host_func"] == results["queue"]
    # a batch put while a host function of an earlier one is in flight gets none (the gated
    # first batch's is): it is settled after that wake, by its own synchronize
    assert fake.host_funcs.launched + inbox.skipped == 12  # type: ignore[attr-defined]
    assert inbox.skipped > 0


def test_nothing_settles_before_the_end_and_no_wake_at_submit(fake: FakeCuda) -> None:
    rng = np.random.default_rng(6)
    with _engine() as engine:
        inbox = engine._streams._queues[Direction.D2H]
        assert isinstance(inbox, _host_wake.HostFuncInbox)
        gate = fake.gate()
        plan, *_ = _store(rng)
        handle = engine.submit(plan)
        buffers = engine.issuer.buffers
        time.sleep(0.05)  # the completion thread had every chance to run
        assert not handle.done() and buffers.num_allocated == 1 and not any(buffers._free.values())
        assert fake.host_funcs.fired == 0 and inbox.credited == 0  # type: ignore[attr-defined]
        gate.set()
        assert handle.future.result(timeout=5).num_bytes == plan.num_bytes
        assert any(buffers._free.values())  # the table went back after the end only
    assert fake.host_funcs.fired == 1  # type: ignore[attr-defined]


def test_a_refused_launch_still_settles_its_batch_after_its_end(fake: FakeCuda) -> None:
    rng = np.random.default_rng(7)
    fake.host_funcs.refuse = True  # type: ignore[attr-defined]
    with _engine() as engine:
        gate = fake.gate()
        plan, src, dst, s, d = _store(rng)
        handle = engine.submit(plan)
        time.sleep(0.05)
        assert not handle.done()  # its credit woke the thread: it waits in synchronize
        gate.set()
        handle.future.result(timeout=5)
        assert all(torch.equal(a[s], b[d]) for a, b in zip(src, dst))


def test_a_device_error_surfaces_although_no_host_function_runs(fake: FakeCuda) -> None:
    rng = np.random.default_rng(8)
    fake.host_funcs.broken = True  # type: ignore[attr-defined]
    engine = _engine()
    inbox = engine._streams._queues[Direction.D2H]
    fake.failing = True  # type: ignore[attr-defined]
    batch = _store(rng)  # (its tensors alive: the fake driver copies at submit)
    handle = engine.submit(batch[0])
    with pytest.raises(TransferError, match="failed on the device"):
        handle.future.result(timeout=5)
    assert inbox.polls >= 1  # found by the thread's own look, not by a wake
    engine.close()
    assert engine.statistics().batches_failed == 1
    with pytest.raises(OSError):  # closed through the target: a late host function writes nothing
        os.fstat(inbox._fd)
    fake.host_funcs.broken = False  # type: ignore[attr-defined]
    wake = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_host_wake.wake_address())
    reused = os.eventfd(0, os.EFD_NONBLOCK)  # (may get the closed descriptor's number)
    try:
        wake(inbox._target)  # the host function the driver never ran, running late
        with pytest.raises(BlockingIOError):
            os.eventfd_read(reused)
    finally:
        os.close(reused)


def test_close_settles_everything_then_closes_the_eventfds(fake: FakeCuda) -> None:
    rng = np.random.default_rng(9)
    engine = _engine()
    inboxes = list(engine._streams._queues.values())
    batches = [_store(rng) for _ in range(5)]
    handles = [engine.submit(b[0]) for b in batches]
    engine.close()
    assert all(h.done() for h in handles)
    for inbox in inboxes:
        with pytest.raises(OSError):
            os.fstat(inbox._fd)


def test_the_choice_and_its_fallback(fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    with pytest.raises(ConfigError, match="completion"):
        _engine(completion="poll")
    monkeypatch.setenv("KVMGR_COMPLETION", "bogus")
    with pytest.raises(ConfigError, match="completion"):
        _engine()
    monkeypatch.delenv("KVMGR_COMPLETION")
    with _engine() as engine:
        assert engine.statistics().completion == "queue"  # the default
    monkeypatch.setenv("KVMGR_COMPLETION", "host_func")
    with _engine() as engine:
        assert engine.statistics().completion == "host_func"
    monkeypatch.setattr(_host_wake, "host_func_launcher", lambda: None)  # no driver entry
    with caplog.at_level(logging.WARNING), _engine() as engine:
        assert engine.statistics().completion == "queue"
    assert "unavailable" in caplog.text


@pytest.mark.gpu
def test_gpu_host_func_completion_waits_for_the_device_and_copies_right() -> None:
    dev = torch.device("cuda", 0)
    with CudaBatchEngine(dev, completion="host_func") as engine:
        assert engine.statistics().completion == "host_func"  # the driver's entry was found
        inboxes = list(engine._streams._queues.values())
        gen = torch.Generator(device="cuda").manual_seed(11)
        gpu = [torch.randint(0, 256, (32, 4096), dtype=torch.uint8, device=dev, generator=gen)
               for _ in range(3)]  # fmt: skip
        flat = engine.allocate_host(3 * 40 * 4096)
        host = list(flat.view(3, 40, 4096).unbind(0))
        layouts = KVLayout.from_tensors(gpu), KVLayout.from_tensors(host)
        warm = engine.submit(build_plan(Direction.D2H, *layouts, [0], [39]))  # a cold first
        warm.future.result(timeout=60)  # submit (tens of ms on a cold host) outlasts no sleep
        for value in (0x3C, 0x5A, 0x77):
            ids = torch.tensor([2, 9, 10, 31], device=dev)
            torch.cuda._sleep(400_000_000)  # the compute stream busy (~0.2 s) before the write
            for t in gpu:
                t.index_fill_(0, ids, value)
            handle = engine.submit(
                build_plan(Direction.D2H, *layouts, [2, 9, 10, 31], [0, 1, 5, 6])
            )
            time.sleep(0.005)
            assert not handle.done()  # the copy waits for the compute stream: nothing settled
            result = handle.future.result(timeout=60)
            assert result.device_s > 0 and bool((torch.stack(host)[:, [0, 1, 5, 6]] == value).all())
        for t in gpu:  # and back, into poisoned blocks
            t[torch.tensor([20, 21, 22, 23], device=dev)] = 0xEE
        load = engine.submit(build_plan(Direction.H2D, layouts[1], layouts[0], [0, 1, 5, 6], [20, 21, 22, 23]))  # fmt: skip
        engine.stream_wait(load)
        assert bool((torch.stack(gpu)[:, 20:24] == 0x77).all())
        load.future.result(timeout=60)
    for inbox in inboxes:  # the eventfds are closed
        with pytest.raises(OSError):
            os.fstat(inbox._fd)
