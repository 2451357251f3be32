"""Fake CUDA for the engine tests without a GPU (``test_cuda_engine``, ``test_copy_kernel``,
``test_layerwise_fake_cuda``, ``test_staged``).

- ``FakeCuda``: ``torch.cuda`` streams and events that log ``(op, object, argument)`` in call
  order; ``install(monkeypatch)`` puts them (and a CPU "device") in place for one test.
- ``FakeDriverLib``: ctypes callbacks standing in for the driver's ``cuMemcpyBatchAsync`` (both
  ABIs) and ``cuMemcpyAsync``: they memmove host memory and log each call.
- ``KernelFakeCuda``: ``FakeCuda`` where the copy kernel runs for real under the Triton
  interpreter on CPU addresses (``test_copy_kernel``, the manager state machine).
- ``FakeDriver``: a duck-typed ``CopyDriver`` whose batches are logged ``memmove`` loops.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvmgr.transfer.driver import MemcpyAttributes

_P, _N = ctypes.c_void_p, ctypes.c_size_t
_LOOP = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _N, _P)
_BATCH = {
    12080: ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _N, _P, _P, _N, _P, _P),
    13000: ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _N, _P, _P, _N, _P),
}


def _u64(address: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address)).copy()


class FakeDriverLib:
    """ctypes callbacks standing in for the driver: they memmove host memory and log calls.

    ``fail_at``: descriptor index whose copy is refused with ``code`` (batch: the whole call).
    """

    def __init__(self, fail_at: int | None = None, code: int = 1, fail_call: int = 0) -> None:
        self.fail_at, self.code, self.fail_call = fail_at, code, fail_call
        self.calls: list[Any] = []
        self.num_batch_calls = 0
        self._callbacks = {abi: proto(self._batch_for(abi)) for abi, proto in _BATCH.items()}
        self._callbacks[0] = _LOOP(self._loop)

    def resolver(self, versions: tuple[int, ...] = (12080, 13000)) -> Any:
        def resolve(symbol: str, version: int) -> int | None:
            self.calls.append({"resolve": (symbol, version)})
            key = 0 if symbol == "cuMemcpyAsync" else version
            if symbol == "cuMemcpyBatchAsync" and version not in versions:
                return None
            return ctypes.cast(self._callbacks[key], ctypes.c_void_p).value

        return resolve

    def _batch_for(self, abi: int) -> Any:
        def batch(dsts: int, srcs: int, sizes: int, count: int, attrs: int, idxs: int,
                  num_attrs: int, *rest: Any) -> int:  # fmt: skip
            fail_idx, stream = (rest[0], rest[1]) if abi == 12080 else (None, rest[0])
            d, s, n = (_u64(p, count) for p in (dsts, srcs, sizes))
            order = MemcpyAttributes.from_address(attrs).srcAccessOrder
            self.calls.append({"batch": abi, "count": count, "order": order, "stream": stream or 0,
                               "idxs": _u64(idxs, num_attrs).tolist(), "num_attrs": num_attrs})  # fmt: skip
            self.num_batch_calls += 1
            failing = self.num_batch_calls - 1 == self.fail_call
            if failing and self.fail_at is not None and self.fail_at < count:
                if fail_idx is not None:
                    ctypes.c_size_t.from_address(fail_idx).value = self.fail_at
                return self.code
            for i in range(count):
                ctypes.memmove(int(d[i]), int(s[i]), int(n[i]))
            return 0

        return batch

    def _loop(self, dst: int, src: int, size: int, stream: int | None) -> int:
        index = sum(isinstance(c, dict) and "loop" in c for c in self.calls)
        self.calls.append({"loop": index, "stream": stream or 0})
        if index == self.fail_at:
            return self.code
        ctypes.memmove(dst, src, size)
        return 0


class FakeCuda:
    """``torch.cuda`` streams and events that log ``(op, object, argument)`` in call order.

    A blocking (end) event created while ``gates`` is non-empty takes the first gate and its
    ``synchronize`` waits for it: the batch "runs" until the test sets the gate. Every event pair
    reports ``elapsed_ms`` between them.
    """

    def __init__(self, elapsed_ms: float = 0.5) -> None:
        self.log: list[Any] = []
        self.gates: list[threading.Event] = []
        handles = itertools.count(0x100)
        fake = self

        class Stream:
            def __init__(self, device: Any = None, priority: int = 0) -> None:
                self.cuda_stream, self.priority = next(handles), priority

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait", self, event))

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                self.gate = fake.gates.pop(0) if blocking and fake.gates else None

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", self, stream))

            def synchronize(self) -> None:
                assert self.gate is None or self.gate.wait(10)

            def query(self) -> bool:
                return self.gate is None or self.gate.is_set()

            def elapsed_time(self, end: Any) -> float:
                return elapsed_ms

        self.Stream, self.Event = Stream, Event
        self.compute = Stream()

    def gate(self) -> threading.Event:
        """A gate for the next blocking event: its batch "runs" until the test sets it."""
        gate = threading.Event()
        self.gates.append(gate)
        return gate

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        """Make ``torch.cuda`` these streams and events on device 0 (no capture) for one test."""
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        return self


def hold_two_tables(fake: FakeCuda, engine: Any, pool: Any, plan: Any) -> None:
    """Submit ``plan`` twice while the first batch is gated and check that each batch in flight
    holds its own table of ``pool`` (a ``TableSlots`` or descriptor buffer pool), none free
    (rule 7: memory a stream may still read is never handed out again); then let both end."""
    gate = fake.gate()
    first = engine.submit(plan)
    assert pool.num_allocated == 1 and not any(pool._free.values())
    second = engine.submit(plan)  # a second batch in flight takes a second table
    assert pool.num_allocated == 2
    gate.set()
    first.future.result(timeout=5)
    second.future.result(timeout=5)


class KernelFakeCuda(FakeCuda):
    """``FakeCuda`` where the copy kernel runs for real (interpreter, CPU addresses) and logs
    ``("kernel", rows, cap)`` / ``("paged", rows, cap)``; ``fail_launches`` refuses that many.
    Needs ``TRITON_INTERPRET=1`` (set by the conftest without a GPU)."""

    def __init__(self) -> None:
        super().__init__(elapsed_ms=0.25)
        self.fail_launches = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> KernelFakeCuda:
        """``FakeCuda.install``, and the copy kernel's launches and table slots on the CPU."""
        from kvmgr.kernels.copy import staging

        super().install(monkeypatch)
        monkeypatch.setattr(staging, "launch_copy_table", self.launch)
        monkeypatch.setattr(staging, "launch_block_table", self.launch_paged)
        monkeypatch.setattr(staging, "new_table_slot", cpu_table_slot)
        return self

    def launch(self, table: torch.Tensor, num_items: int, max_programs: int, **_: Any) -> int:
        from kvmgr.kernels.copy.pages import launch_copy_table

        self._refuse()
        self.log.append(("kernel", num_items, max_programs))
        return launch_copy_table(table, num_items, max_programs)  # interpreter, CPU addresses

    def launch_paged(
        self, layout: torch.Tensor, runs: torch.Tensor, num_tensors: int, num_runs: int,
        max_programs: int, **_: Any,
    ) -> int:  # fmt: skip
        from kvmgr.kernels.copy.blocks import launch_block_table

        self._refuse()
        self.log.append(("paged", num_tensors * num_runs, max_programs))
        return launch_block_table(layout, runs, num_tensors, num_runs, max_programs)

    def _refuse(self) -> None:
        if self.fail_launches:
            self.fail_launches -= 1
            raise RuntimeError("launch refused")


def cpu_table_slot(capacity: int, device: Any) -> Any:
    """A copy-kernel table slot of ``capacity`` rows in CPU memory (for ``staging.new_table_slot``)."""
    from kvmgr.kernels.copy import staging

    host, table = (torch.zeros(3 * capacity, dtype=torch.int64) for _ in range(2))
    return staging.TableSlot(capacity, host, host.numpy(), table, host.data_ptr(), table.data_ptr())


class FakeDriver:
    """Duck-typed ``CopyDriver``: every batch is a logged ``memmove`` loop."""

    batch_abi = driver_version = 13000

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def batch_at(self, dsts: int, srcs: int, sizes: int, count: int, stream: int, order: int):  # type: ignore[no-untyped-def]
        from kvmgr.kernels.copy.pages import copy_pages_reference

        self.log.append(("dma", count, order))
        d, s, n = (np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(a)).copy()
                   for a in (dsts, srcs, sizes))  # fmt: skip
        copy_pages_reference(s, d, n)

    def memcpy(self, dst: int, src: int, num_bytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, num_bytes)
