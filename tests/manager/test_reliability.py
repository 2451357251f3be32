"""Reliability: a stateful fault-injection model, timeouts, cancellation, shutdown, backpressure,
metrics.

The stateful test drives one manager through random swaps (``swap_out``/``swap_in`` and
``store_many``/``load_many`` over two requests' blocks), lookups, steps, preempts, resumes,
frees, cancellations, timed-out awaits and injected faults (failed, hung, held, refused, delayed
batches); after every step ``check_invariants`` passes and every completed load holds the
bytes stored under its key. It uses only the public API: GPU blocks come from ``allocate``, and
a swap is known settled when it left ``snapshot().swaps``. Profiles: ``KVMGR_STATEFUL=ci`` (default, a few seconds) and
``KVMGR_STATEFUL=long`` (``KVMGR_STATEFUL_EXAMPLES`` examples, default 3000), for example::

    KVMGR_STATEFUL=long python -m pytest -q -s tests/manager/test_reliability.py -k Stateful --timeout 0
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvmgr import (
    ClosedError,
    ManagerConfig,
    ManagerStatistics,
    OffloadManager,
    PoolExhaustedError,
    Tier,
    TransferError,
    TransferTimeoutError,
)
from kvmgr.manager import CpuState, SwapSnapshot
from kvmgr.metrics import PrometheusExporter, metrics_snapshot
from kvmgr.testing import FaultyEngine, ScriptedEngine, VirtualClock, check_invariants
from kvmgr.transfer import ENGINES, HostEngine, make_engine

NUM_GPU, NUM_CPU = 20, 10
KEYS = [f"key-{i:02d}".encode() for i in range(14)]
#: Totals over every example of the stateful test in this process (printed with -s).
STATEFUL_TOTALS: Counter[str] = Counter()


def make_kv(seed: int = 0, num_blocks: int = NUM_GPU) -> list[torch.Tensor]:
    """Two irregular KV tensors: fp32 [n, 3, 5] (60 B pages) and uint8 27 B pages, 40 B apart."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(num_blocks, 3, 5, generator=gen)
    strided = torch.randint(0, 256, (num_blocks, 40), generator=gen, dtype=torch.uint8)[:, :27]
    return [dense, strided]


def page_rows(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor as uint8 ``[num_blocks, page_bytes]`` views (writes go to the tensors)."""
    return [t if t.dtype == torch.uint8 else t.view(t.shape[0], -1).view(torch.uint8) for t in kv]


def label_pages(label: bytes, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The bytes a block holds when it holds ``label`` (a key's KV): seeded by the label."""
    seed = int.from_bytes(hashlib.blake2b(label, digest_size=8).digest(), "little")
    gen = np.random.default_rng(seed)
    return [torch.from_numpy(gen.integers(0, 256, r.shape[1], dtype=np.uint8)) for r in rows]


def kvmgr_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvmgr")]


def _signature(swap: SwapSnapshot) -> tuple[Any, ...]:
    """What names one unsettled swap in ``snapshot().swaps`` whether queued or in flight."""
    return (swap.kind, swap.gpu_block_ids, swap.cpu_block_ids, swap.keys, swap.req_id)


def unsettled(mgr: OffloadManager) -> Counter[tuple[Any, ...]]:
    """Signatures of the swaps queued or in flight (a multiset)."""
    return Counter(_signature(s) for s in mgr.snapshot().swaps)


def queue_swap(mgr: OffloadManager, call: Any) -> tuple[Any, tuple[Any, ...] | None]:
    """Run ``call()`` (a swap) and return its future and the signature of the swap it queued
    (``None``: nothing to copy, the future is already resolved)."""
    before = unsettled(mgr)
    future = call()
    new = unsettled(mgr) - before
    assert sum(new.values()) <= 1, f"one call queued several swaps: {new}"
    return future, next(iter(new), None)


async def batches_end(mgr: OffloadManager, keep: Any = (), timeout_s: float = 10.0) -> bool:
    """Wait (real time) until every batch in flight now, except the engine batch ids in
    ``keep``, has ended and its bookkeeping ran; False if some did not end in time."""
    targets = {b.engine_batch_id for b in mgr.snapshot().batches} - set(keep)
    deadline = time.monotonic() + timeout_s
    while targets & {b.engine_batch_id for b in mgr.snapshot().batches}:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.0005)
    for _ in range(3):
        await asyncio.sleep(0)
    return True


# ====================================================================== stateful model


@attrs.define(eq=False)
class _ModelOp:
    kind: str  # "store", "load", "preempt", "resume"
    future: asyncio.Future[Any]
    sig: tuple[Any, ...] | None  # its signature in snapshot().swaps; None: nothing queued
    req: str | None = None
    reads: list[int] = attrs.field(factory=list)  # GPU blocks the copy reads
    writes: list[int] = attrs.field(factory=list)  # GPU blocks the copy writes
    expect: list[bytes | None] = attrs.field(factory=list)  # labels of `writes` on success


class ManagerMachine(RuleBasedStateMachine):
    """A serving loop's use of the manager, with a FaultyEngine lying about some batches."""

    #: KV tensors' device and the engine wrapped by the FaultyEngine there.
    DEVICE, ENGINE = "cpu", "host"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.mgr: OffloadManager | None = None
        self.engine: FaultyEngine | None = None
        self.ops: list[_ModelOp] = []
        self.label: dict[int, bytes | None] = {}  # GPU block -> label of its bytes
        self.swapped: dict[str, list[bytes | None]] = {}  # preempted request -> its labels
        self.num_reqs = 0
        self.totals: Counter[str] = Counter()

    # ------------------------------------------------------------------ plumbing

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        flush=st.sampled_from(["step", "step", "tick"]),
        fail_rate=st.sampled_from([0.0, 0.05, 0.2]),
        hang=st.sets(st.integers(0, 30), max_size=2),
        refuse=st.sets(st.integers(0, 30), max_size=2),
        delay_s=st.sampled_from([0.0, 0.0, 0.0005]),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self,
        policy: str,
        flush: str,
        fail_rate: float,
        hang: set[int],
        refuse: set[int],
        delay_s: float,
        seed: int,
    ) -> None:
        self.kv = [t.to(self.DEVICE) for t in make_kv(seed)]
        self.rows = page_rows(self.kv)
        config = ManagerConfig(
            num_cpu_blocks=NUM_CPU, policy=policy, flush=flush, engine=self.ENGINE
        )
        self.engine = FaultyEngine(
            make_engine(self.ENGINE, self.kv[0].device, config),
            fail_rate=fail_rate,
            hang_batches=hang,
            refuse_batches=refuse,
            delay_s=delay_s,
            seed=seed,
        )
        self.mgr = OffloadManager(self.kv, config, engine=self.engine)
        self.run(self.mgr.__aenter__())
        for n in (4, 3, 4):  # a few running requests to start with
            self.new_request(n)

    def write(self, block: int, label: bytes) -> None:
        for row, page in zip(self.rows, label_pages(label, self.rows)):
            row[block] = page.to(row.device)
        self.label[block] = label

    def check(self, block: int, label: bytes | None, what: str) -> None:
        if label is None:
            return
        for t, (row, page) in enumerate(zip(self.rows, label_pages(label, self.rows))):
            assert torch.equal(row[block].cpu(), page), (
                f"{what}: GPU block {block} tensor {t} does not hold the bytes of {label!r}"
            )
        self.totals["bytes_checked"] += 1

    def sync(self) -> None:
        """Apply every op the manager has settled: check loaded and resumed bytes."""
        assert self.mgr is not None
        live = unsettled(self.mgr)
        settled = []
        for op in self.ops:
            if op.sig is not None and live[op.sig] > 0:
                live[op.sig] -= 1
            else:
                settled.append(op)
        for op in settled:
            self.ops.remove(op)
            assert op.future.done(), f"{op.kind} settled but its future is pending"
            ok = not op.future.cancelled() and op.future.exception() is None
            self.totals[f"{op.kind}_{'ok' if ok else 'failed_or_cancelled'}"] += 1
            if op.kind == "load":
                for block, key in zip(op.writes, op.expect):
                    if ok:
                        self.check(block, key, "completed swap_in")
                    self.label[block] = key if ok else None
            elif op.kind == "resume" and self.tier(op.req) is Tier.GPU:
                # resumed (also when its await was cancelled)
                for block, label in zip(self.ids(str(op.req)), op.expect):
                    self.check(block, label, "completed resume")
                    self.label[block] = label
                self.swapped.pop(str(op.req), None)
            elif op.kind == "preempt" and self.tier(op.req) is Tier.CPU:
                self.swapped[str(op.req)] = op.expect

    def tier(self, req: str | None) -> Tier | None:
        assert self.mgr is not None
        table = self.mgr.snapshot().tables.get(req)
        return None if table is None else table.tier

    def busy(self) -> tuple[set[int], set[int]]:
        reads = {b for op in self.ops for b in op.reads}
        writes = {b for op in self.ops for b in op.writes}
        return reads, writes

    def requests(self, *, tier: Tier) -> list[str]:
        assert self.mgr is not None
        tables = self.mgr.snapshot().tables
        return sorted(r for r, t in tables.items() if t.tier is tier and not t.moving)

    # ------------------------------------------------------------------ rules

    @rule(n=st.integers(1, 4))
    def new_request(self, n: int) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            req = f"req-{self.num_reqs}"
            self.num_reqs += 1
            free = self.mgr.statistics().gpu_blocks_free
            assert free is not None
            if free < n:
                with pytest.raises(PoolExhaustedError):
                    self.mgr.allocate(req, n)
                return
            for i, block in enumerate(self.mgr.allocate(req, n)):
                self.write(block, f"{req}/{i}".encode())  # the request's own KV

        self.run(body())

    def pick_blocks(self, reqs: list[str], pick: int, start: int, n: int, many: bool) -> list[int]:
        """Blocks ``start:start+n`` of one resident request, or of two (``store_many`` and
        ``load_many`` carry several requests' blocks in one call)."""
        ids = self.ids(reqs[pick % len(reqs)])[start : start + n]
        if many:
            ids += self.ids(reqs[(pick // 7 + 1) % len(reqs)])[: n + 1]
        return list(dict.fromkeys(ids))

    @rule(
        pick=st.integers(0, 99),
        start=st.integers(0, 3),
        n=st.integers(1, 4),
        k=st.integers(0, 99),
        many=st.booleans(),
    )
    def store(self, pick: int, start: int, n: int, k: int, many: bool) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            reqs = self.requests(tier=Tier.GPU)
            if not reqs:
                return
            reads, writes = self.busy()
            ids = self.pick_blocks(reqs, pick, start, n, many)
            ids = [b for b in ids if b not in reads | writes]
            keys = [KEYS[(k + i) % len(KEYS)] for i in range(len(ids))]
            for block, key in zip(ids, keys):
                self.write(block, key)  # compute produced this prefix's KV
            mgr = self.mgr
            try:
                call = mgr.store_many if many else mgr.swap_out
                future, sig = queue_swap(mgr, lambda: call(ids, keys))
            except PoolExhaustedError as exc:
                assert exc.reason == "cpu_full"
                self.totals["store_rejected"] += 1
                return
            self.ops.append(_ModelOp("store", future, sig, reads=list(ids)))
            self.totals["store_many" if many else "swap_out"] += 1

        self.run(body())

    @rule(
        pick=st.integers(0, 99),
        start=st.integers(0, 3),
        n=st.integers(1, 3),
        k=st.integers(0, 99),
        many=st.booleans(),
    )
    def load(self, pick: int, start: int, n: int, k: int, many: bool) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            index = self.mgr.snapshot().keys
            ready = [key for key in KEYS if key in index and index[key].state is CpuState.READY]
            reqs = self.requests(tier=Tier.GPU)
            if not ready or not reqs:
                return
            _, writes = self.busy()  # loading into a block a store still reads is allowed
            ids = self.pick_blocks(reqs, pick, start, n, many)
            ids = [b for b in ids if b not in writes]
            keys = [ready[(k + i) % len(ready)] for i in range(len(ids))]
            assert self.mgr.lookup(keys[:1]) == len(keys[:1])
            mgr = self.mgr
            if many:  # repeated keys: one key into several blocks
                keys = [keys[(i * k) % len(keys)] for i in range(len(keys))]
            call = mgr.load_many if many else mgr.swap_in
            future, sig = queue_swap(mgr, lambda: call(keys, ids))
            self.ops.append(_ModelOp("load", future, sig, writes=list(ids), expect=list(keys)))
            self.totals["load_many" if many else "swap_in"] += 1

        self.run(body())

    @rule(pick=st.integers(0, 99))
    def preempt(self, pick: int) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            _, writes = self.busy()
            reqs = [r for r in self.requests(tier=Tier.GPU) if not set(self.ids(r)) & writes]
            if not reqs:
                return
            req = reqs[pick % len(reqs)]
            ids = self.ids(req)
            mgr = self.mgr
            try:
                future, sig = queue_swap(mgr, lambda: mgr.preempt(req))
            except PoolExhaustedError:
                return
            labels = [self.label.get(b) for b in ids]
            self.ops.append(_ModelOp("preempt", future, sig, req=req, reads=ids, expect=labels))

        self.run(body())

    def ids(self, req: str) -> list[int]:
        assert self.mgr is not None
        return [b for _, b in self.mgr.block_table(req)]

    @rule(pick=st.integers(0, 99))
    def resume(self, pick: int) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            reqs = [r for r in self.requests(tier=Tier.CPU) if r in self.swapped]
            if not reqs:
                return
            req = reqs[pick % len(reqs)]
            mgr = self.mgr
            try:
                future, sig = queue_swap(mgr, lambda: mgr.resume(req))
            except PoolExhaustedError as exc:
                assert exc.reason == "gpu_full"
                return
            self.ops.append(_ModelOp("resume", future, sig, req=req, expect=self.swapped[req]))

        self.run(body())

    @rule(pick=st.integers(0, 99))
    def free(self, pick: int) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            reqs = self.requests(tier=Tier.GPU) + self.requests(tier=Tier.CPU)
            if reqs:  # even while stores read or loads write its blocks
                req = reqs[pick % len(reqs)]
                self.mgr.free(req)
                self.swapped.pop(req, None)

        self.run(body())

    @rule()
    def step(self) -> None:
        async def body() -> None:
            assert self.mgr is not None
            await self.mgr.step()
            self.sync()

        self.run(body())

    @rule()
    def settle(self) -> None:
        """Wait (real time, bounded) for every batch the engine does not hold: none may hang."""

        async def body() -> None:
            assert self.mgr is not None and self.engine is not None
            waiting = set(self.engine.waiting_batch_ids)
            assert await batches_end(self.mgr, keep=waiting), (
                "a batch that is not held never completed"
            )
            self.sync()

        self.run(body())

    @rule(pick=st.integers(0, 99), timeout_s=st.sampled_from([0.0, 0.0005, 0.003]))
    def await_with_deadline(self, pick: int, timeout_s: float) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            live = [op for op in self.ops if not op.future.cancelled()]
            if not live:
                return
            op = live[pick % len(live)]
            try:
                await self.mgr.wait(op.future, timeout_s)
                self.totals["await_ok"] += 1
            except TransferTimeoutError:
                self.totals["await_timeout"] += 1
            except TransferError:
                self.totals["await_failed"] += 1
            self.sync()

        self.run(body())

    @rule(pick=st.integers(0, 99), shielded=st.booleans())
    def cancel_an_await(self, pick: int, shielded: bool) -> None:
        async def body() -> None:
            assert self.mgr is not None
            self.sync()
            live = [op for op in self.ops if not op.future.done()]
            if not live:
                return
            op = live[pick % len(live)]
            awaiting = self.mgr.wait(op.future) if shielded else _await(op.future)
            task = asyncio.ensure_future(awaiting)
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if shielded:
                assert not op.future.cancelled(), "cancelling mgr.wait cancelled the swap"
            self.totals["cancelled_await"] += 1
            self.sync()

        self.run(body())

    @rule(action=st.sampled_from(["hold", "complete", "fail", "release"]), n=st.integers(1, 3))
    def control_engine(self, action: str, n: int) -> None:
        """Hold later batches, start (or fail) the oldest held ones, or release them all."""
        assert self.engine is not None
        if action == "hold":
            self.engine.hold()
        elif action == "release":
            self.engine.release()
        else:
            self.engine.complete_next(n, fail=action == "fail")

    # ------------------------------------------------------------------ checks

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        if self.mgr is not None:
            check_invariants(self.mgr)
            self.totals["operations"] += 1

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                self.run(self._drain())
        finally:
            if self.mgr is not None:
                self.run(self.mgr.aclose(timeout_s=5.0))
            self.loop.close()
            STATEFUL_TOTALS.update(self.totals)
            STATEFUL_TOTALS["examples"] += 1
        assert kvmgr_threads() == [], kvmgr_threads()

    async def _drain(self) -> None:
        """Release every batch and run until nothing is queued or in flight (bounded)."""
        assert self.mgr is not None and self.engine is not None
        for _ in range(20):
            await self.mgr.step()
            self.engine.release()
            assert await batches_end(self.mgr), "a released batch never completed"
            stats = self.mgr.statistics()
            if not stats.batches_in_flight and not stats.queued_swaps:
                break
        self.sync()
        assert not self.ops, f"{len(self.ops)} swaps never settled"
        check_invariants(self.mgr)
        stats = self.mgr.statistics()
        assert stats.stores_queued == stats.stores_completed + stats.stores_failed
        assert stats.loads_queued == stats.loads_completed + stats.loads_failed
        assert stats.cpu_keys_pending == 0 and stats.batches_in_flight == 0


async def _await(future: asyncio.Future[Any]) -> Any:
    return await future


_PROFILES = {
    "ci": settings(max_examples=200, stateful_step_count=60),
    "long": settings(
        max_examples=int(os.environ.get("KVMGR_STATEFUL_EXAMPLES", "3000")),
        stateful_step_count=120,
    ),
}
TestStatefulManager = ManagerMachine.TestCase
TestStatefulManager.settings = settings(
    _PROFILES[os.environ.get("KVMGR_STATEFUL", "ci")],
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _gpu_machine(engine: str) -> Any:
    """The same model on CUDA tensors with engine ``engine`` under the FaultyEngine."""
    machine = type(f"{engine.title()}ManagerMachine", (ManagerMachine,), {})
    machine.DEVICE, machine.ENGINE = "cuda", engine
    case = machine.TestCase
    case.settings = settings(
        max_examples=int(os.environ.get("KVMGR_STATEFUL_GPU_EXAMPLES", "25")),
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return pytest.mark.gpu(case)


#: The state machine over every engine ``make_engine`` builds: host on CPU tensors (above),
#: the others on CUDA tensors (GPU runs only).
GPU_ENGINES = ("cuda", "kernel", "auto")
TestStatefulManagerCuda, TestStatefulManagerKernel, TestStatefulManagerAuto = map(
    _gpu_machine, GPU_ENGINES
)


def test_the_state_machine_covers_every_engine() -> None:
    assert {ManagerMachine.ENGINE, *GPU_ENGINES} == set(ENGINES), "a new engine: add a machine"


@pytest.fixture(scope="module", autouse=True)
def _print_stateful_totals() -> Iterator[None]:
    yield
    if STATEFUL_TOTALS:
        print(f"\nstateful totals: {dict(sorted(STATEFUL_TOTALS.items()))}")


# ====================================================================== scenarios

BLOCK_BYTES = 60 + 27


@contextlib.asynccontextmanager
async def opened(
    kv: list[torch.Tensor], config: ManagerConfig, engine: FaultyEngine
) -> AsyncIterator[OffloadManager]:
    """The manager, open; on exit (even after a failed assertion) the engine is released so
    that closing never waits on a hung batch."""
    mgr = OffloadManager(kv, config, engine=engine)
    await mgr.__aenter__()
    try:
        yield mgr
    finally:
        engine.release()
        await mgr.aclose(timeout_s=2.0)


def cpu_page(mgr: OffloadManager, key: bytes) -> list[torch.Tensor]:
    block = mgr.snapshot().keys[key].cpu_block_id
    return [pages[block].clone() for pages in mgr.cpu_pool.tensors]


def gpu_page(kv: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [rows[block].clone() for rows in page_rows(kv)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


async def until(predicate: Any, rounds: int = 50) -> bool:
    """Yield to the loop until ``predicate()`` holds (at most ``rounds`` times)."""
    for _ in range(rounds):
        if predicate():
            return True
        await asyncio.sleep(0)
    return bool(predicate())


@pytest.mark.asyncio
async def test_timed_out_store_stays_fenced_until_its_copy_ends() -> None:
    kv = make_kv(3)
    engine = FaultyEngine(HostEngine(), hang_batches={0})
    config = ManagerConfig(num_cpu_blocks=4)
    async with opened(kv, config, engine) as mgr:
        loop = asyncio.get_running_loop()
        with VirtualClock().install(loop) as clock:
            # 1. a store whose completion never arrives; its await has a 30 s deadline
            gpu = mgr.allocate("r", 3)
            expected = [gpu_page(kv, b) for b in gpu]
            store = mgr.swap_out(gpu, KEYS[:3])
            await mgr.step()
            waiting = asyncio.ensure_future(mgr.wait(store, timeout_s=30.0))
            await asyncio.sleep(0)  # let it start: its deadline is set when it runs
            clock.advance(29.9)
            assert not await until(waiting.done)
            clock.advance(0.1)
            with pytest.raises(TransferTimeoutError):
                await waiting
            # 2. its keys stay PENDING: not readable, not evictable
            assert mgr.lookup(KEYS[:3]) == 0 and mgr.statistics().cpu_keys_pending == 3
            with pytest.raises(PoolExhaustedError):
                mgr.swap_out(mgr.allocate("s", 2), KEYS[3:5])
            # 3. freeing the request does not hand out the GPU blocks the copy still reads
            mgr.free("r")
            assert mgr.statistics().gpu_blocks_free == NUM_GPU - 5
            assert not set(gpu) & set(mgr.allocate("t", 15))
            check_invariants(mgr)
            # 4. the copy ends: READY with the bytes of store time, GPU blocks back in the pool
            engine.release()
            await store
            assert mgr.lookup(KEYS[:3]) == 3 and not store.cancelled()
            assert all(same(cpu_page(mgr, k), e) for k, e in zip(KEYS, expected))
            assert set(gpu) <= set(mgr.allocate("u", 3))
            check_invariants(mgr)


@pytest.mark.asyncio
async def test_timed_out_load_keeps_its_key_pinned() -> None:
    kv = make_kv(4)
    engine = FaultyEngine(HostEngine())
    async with opened(kv, ManagerConfig(num_cpu_blocks=2), engine) as mgr:
        gpu = mgr.allocate("r", 4)
        expected = gpu_page(kv, gpu[0])
        store = mgr.swap_out(gpu[:2], KEYS[:2])
        await mgr.step()
        await store
        engine.hold()
        load = mgr.swap_in([KEYS[0]], [gpu[2]])
        await mgr.step()
        with pytest.raises(TransferTimeoutError):
            await mgr.wait(load, timeout_s=0.01)
        # the loading key cannot be evicted; the other one can
        assert mgr.snapshot().keys[KEYS[0]].readers == 1
        with pytest.raises(PoolExhaustedError):
            mgr.swap_out(gpu[2:], KEYS[2:4])  # would need both blocks
        check_invariants(mgr)
        engine.release()
        await load
        assert mgr.snapshot().keys[KEYS[0]].readers == 0 and same(gpu_page(kv, gpu[2]), expected)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_cancelling_awaits_never_cancels_copies() -> None:
    kv = make_kv(5)
    engine = FaultyEngine(HostEngine())
    async with opened(kv, ManagerConfig(num_cpu_blocks=6), engine) as mgr:
        gpu = mgr.allocate("r", 5)
        expected = [gpu_page(kv, b) for b in gpu[:3]]
        engine.hold()
        # 1. a task awaiting the store directly is cancelled: the future is, the copy is not
        store = mgr.swap_out(gpu[:3], KEYS[:3])
        await mgr.step()
        task = asyncio.ensure_future(_await(store))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert store.cancelled() and mgr.statistics().cpu_keys_pending == 3
        engine.release()
        assert await until(lambda: mgr.lookup(KEYS[:3]) == 3, rounds=10_000)
        assert all(same(cpu_page(mgr, k), e) for k, e in zip(KEYS, expected))
        # 2. a task in mgr.wait is cancelled: the load's own future survives and completes
        engine.hold()
        load = mgr.swap_in(KEYS[:2], gpu[3:5])
        await mgr.step()
        task = asyncio.ensure_future(mgr.wait(load, timeout_s=60.0))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not load.cancelled()
        engine.release()
        await load
        assert same(gpu_page(kv, gpu[3]), expected[0]) and same(gpu_page(kv, gpu[4]), expected[1])
        stats = mgr.statistics()
        assert stats.stores_completed == 3 and stats.loads_completed == 2
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_failed_store_is_never_ready_and_its_retry_is() -> None:
    kv = make_kv(6)
    engine = FaultyEngine(HostEngine(), fail_batches={0})
    async with opened(kv, ManagerConfig(num_cpu_blocks=4), engine) as mgr:
        gpu = mgr.allocate("r", 3)
        store = mgr.swap_out(gpu, KEYS[:3])
        await mgr.step()
        with pytest.raises(TransferError, match="injected"):
            await store
        # the copy ran, then was poisoned: the keys are gone and their blocks free
        assert mgr.lookup(KEYS[:3]) == 0 and KEYS[0] not in mgr.snapshot().keys
        assert mgr.statistics().cpu_blocks_used == 0 and mgr.statistics().stores_failed == 3
        check_invariants(mgr)
        retry = mgr.swap_out(gpu, KEYS[:3])
        await mgr.step()
        await retry
        assert same(cpu_page(mgr, KEYS[1]), gpu_page(kv, gpu[1]))
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_close_waits_for_copies_then_fails_the_rest_and_leaves_nothing() -> None:
    kv = make_kv(7)
    engine = FaultyEngine(HostEngine(), delay_s=0.05, hang_batches={1})
    mgr = OffloadManager(kv, ManagerConfig(num_cpu_blocks=8), engine=engine)
    async with mgr:
        gpu = mgr.allocate("r", 6)
        slow = mgr.swap_out(gpu[:2], KEYS[:2])  # batch 0: completes 50 ms after its copy
        await mgr.step()
        hung = mgr.swap_out(gpu[2:4], KEYS[2:4])  # batch 1: never completes
        await mgr.step()
        queued = mgr.swap_out(gpu[4:], KEYS[4:6])  # never flushed
        awaiting = [asyncio.ensure_future(_await(f)) for f in (slow, hung, queued)]
        start = time.perf_counter()
        await mgr.aclose(timeout_s=0.3)
    assert time.perf_counter() - start < 1.5  # bounded
    outcomes = await asyncio.gather(*awaiting, return_exceptions=True)
    assert outcomes[0].num_blocks == 2  # waited for
    assert isinstance(outcomes[1], ClosedError) and isinstance(outcomes[2], ClosedError)
    assert kvmgr_threads() == []
    assert asyncio.all_tasks() == {asyncio.current_task()}
    check_invariants(mgr)
    with pytest.raises(ClosedError):
        mgr.swap_out([gpu[0]], [KEYS[9]])
    with pytest.raises(ClosedError):
        await mgr.step()


def _stuck_engine() -> ScriptedEngine:
    """Batches never complete and ``close`` times out: a CUDA engine with a hung stream."""
    return ScriptedEngine(HostEngine(), hold=True, close_hangs=True)


@pytest.mark.asyncio
async def test_close_fails_every_await_even_when_the_engine_close_times_out() -> None:
    mgr = OffloadManager(make_kv(14), ManagerConfig(num_cpu_blocks=4), engine=_stuck_engine())
    await mgr.__aenter__()
    store = mgr.swap_out(mgr.allocate("r", 2), KEYS[:2])
    await mgr.step()
    awaiting = asyncio.ensure_future(_await(store))
    with pytest.raises(TransferTimeoutError):  # the engine says copies are still running
        await mgr.aclose(timeout_s=0.05)
    done, _ = await asyncio.wait([awaiting], timeout=2.0)
    if not done or not isinstance(awaiting.exception(), ClosedError):
        awaiting.cancel()
        pytest.fail(f"the await did not fail with ClosedError: {awaiting!r}", pytrace=False)
    assert kvmgr_threads() == []


def _full_tier(mgr: OffloadManager, engine: FaultyEngine) -> tuple[list[int], asyncio.Future[Any]]:
    """Hold the engine, then fill the 4-block CPU tier with PENDING keys 0-3."""
    engine.hold()
    gpu = mgr.allocate("r", 8)
    return gpu, mgr.swap_out(gpu[:4], KEYS[:4])


@pytest.mark.asyncio
async def test_waiting_store_succeeds_when_room_appears_without_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FaultyEngine(HostEngine())
    config = ManagerConfig(num_cpu_blocks=4, backpressure="wait", store_wait_s=5.0)
    async with opened(make_kv(8), config, engine) as mgr:
        with VirtualClock().install(asyncio.get_running_loop()) as clock:
            gpu, first = _full_tier(mgr, engine)
            await mgr.step()
            # every attempt to find room for a store in the full tier asks the policy for
            # victims once: count those calls (the policy is public; it is only observed)
            attempts = Counter[str]()
            evict = mgr.policy.evict
            monkeypatch.setattr(mgr.policy, "evict", lambda *a: attempts.update("x") or evict(*a))
            # 1. no room: the store waits; time passes, nothing else happens: one attempt
            second = mgr.swap_out(gpu[4:6], KEYS[4:6])
            assert not await until(second.done, rounds=100)
            tries = attempts["x"]
            clock.advance(4.9)
            assert not await until(second.done, rounds=200)
            assert attempts["x"] == tries <= 2  # the call, and at most one retry as it starts
            # 2. the first store completes: its keys become evictable, the waiter retries once
            engine.release()
            await first
            assert await until(lambda: mgr.statistics().queued_swaps == 1, rounds=200)
            await mgr.step()
            assert (await second).num_blocks == 2 and attempts["x"] == tries + 1
            stats = mgr.statistics()
            assert stats.evictions == 2 and dict(stats.rejected) == {}
            check_invariants(mgr)


@pytest.mark.asyncio
async def test_waiting_store_times_out_with_a_reason() -> None:
    engine = FaultyEngine(HostEngine())
    config = ManagerConfig(num_cpu_blocks=4, backpressure="wait", store_wait_s=5.0)
    async with opened(make_kv(9), config, engine) as mgr:
        with VirtualClock().install(asyncio.get_running_loop()) as clock:
            gpu, first = _full_tier(mgr, engine)
            await mgr.step()
            second = mgr.swap_out(gpu[4:6], KEYS[4:6])
            clock.advance(5.0)
            with pytest.raises(PoolExhaustedError) as caught:
                await second
            assert caught.value.reason == "timeout" and caught.value.needed == 2
            assert mgr.statistics().rejected == {"timeout": 1}
            assert KEYS[4] not in mgr.snapshot().keys and mgr.statistics().cpu_keys_pending == 4
            check_invariants(mgr)
            engine.release()
            await first


@pytest.mark.asyncio
async def test_store_without_room_fails_at_once_and_is_counted() -> None:
    engine = FaultyEngine(HostEngine())
    async with opened(make_kv(10), ManagerConfig(num_cpu_blocks=4), engine) as mgr:
        gpu, first = _full_tier(mgr, engine)
        before = mgr.statistics()
        with pytest.raises(PoolExhaustedError) as caught:
            mgr.swap_out(gpu[4:6], KEYS[4:6])
        assert caught.value.reason == "cpu_full" and caught.value.available == 0
        after = mgr.statistics()
        assert after.rejected == {"cpu_full": 1}
        assert attrs.evolve(after, rejected={}) == attrs.evolve(before, rejected={})
        check_invariants(mgr)
        await mgr.step()
        engine.release()
        await first


@pytest.mark.asyncio
async def test_refused_batch_wakes_waiting_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FaultyEngine(HostEngine(), refuse_batches={1})
    config = ManagerConfig(num_cpu_blocks=4, backpressure="wait", store_wait_s=5.0)
    async with opened(make_kv(11), config, engine) as mgr:
        with VirtualClock().install(asyncio.get_running_loop()):
            engine.hold()
            gpu = mgr.allocate("r", 6)
            first = mgr.swap_out(gpu[:2], KEYS[:2])
            await mgr.step()  # batch 0, held
            refused = mgr.swap_out(gpu[2:4], KEYS[2:4])  # the tier is now full
            attempts = Counter[str]()  # each attempt to make room asks the policy once
            evict = mgr.policy.evict
            monkeypatch.setattr(mgr.policy, "evict", lambda *a: attempts.update("x") or evict(*a))
            waiting = mgr.swap_out(gpu[4:6], KEYS[4:6])
            assert attempts["x"] == 1  # the call found no room: it waits, no retry yet
            assert not await until(waiting.done, rounds=20) and attempts["x"] == 1
            # batch 1 is refused: its two blocks are free again; the waiting store retries at
            # that moment, takes them (no eviction needed) and the same step submits it
            await mgr.step()
            with pytest.raises(TransferError):
                await refused
            stats = mgr.statistics()
            assert (stats.queued_swaps, stats.stores_waiting, stats.batches_in_flight) == (0, 0, 2)
            engine.release()
            await asyncio.gather(first, waiting)
            check_invariants(mgr)


# ====================================================================== metrics


async def _metrics_scene(mgr: OffloadManager, engine: FaultyEngine) -> None:
    """4 stores, a lookup (2 hits, 1 miss), 2 evicting stores, a load, a held store whose await
    times out, a rejected store."""
    gpu = mgr.allocate("r", 8)
    first = mgr.swap_out(gpu[:4], KEYS[:4])
    await mgr.step()
    await first
    assert mgr.lookup([KEYS[2], KEYS[3], b"missing"]) == 2
    # evicts KEYS[3], KEYS[2]: KEYS[:4] is one chain and eviction is prefix-consistent (leaves
    # first, policy protocol v2), so the touched tail goes and the root KEYS[0] stays
    second = mgr.swap_out(gpu[4:6], KEYS[4:6])
    load = mgr.swap_in([KEYS[0]], [gpu[6]])
    await mgr.step()
    await asyncio.gather(second, load)
    engine.hold()
    held = mgr.swap_out([gpu[7]], [KEYS[6]])  # evicts one more, stays in flight
    await mgr.step()
    with pytest.raises(TransferTimeoutError):
        await mgr.wait(held, timeout_s=0.001)
    with pytest.raises(PoolExhaustedError):
        mgr.swap_out(gpu[:4], KEYS[7:11])


@pytest.mark.asyncio
async def test_metrics_snapshot_counts_what_happened() -> None:
    engine = FaultyEngine(HostEngine())
    async with opened(make_kv(12), ManagerConfig(num_cpu_blocks=4), engine) as mgr:
        await _metrics_scene(mgr, engine)
        snap = metrics_snapshot(mgr)
        assert snap.value("lookups_total") == 1
        assert (snap.value("lookup_hits_total"), snap.value("lookup_misses_total")) == (2, 1)
        assert snap.value("evictions_total", policy="lru") == 3
        assert snap.value("stores_rejected_total", reason="cpu_full") == 1
        assert snap.value("stores_rejected_total", reason="timeout") == 0
        assert snap.value("await_timeouts_total") == 1
        assert snap.value("blocks_stored_total", outcome="completed") == 6
        assert snap.value("transfer_bytes_total", direction="d2h") == 6 * BLOCK_BYTES
        assert snap.value("transfer_bytes_total", direction="h2d") == BLOCK_BYTES
        assert snap.value("transfer_device_seconds_total", direction="h2d") > 0
        assert snap.value("copies_in_flight") == 1
        assert snap.value("cpu_blocks", state="used") == 4
        assert snap.value("cpu_keys", state="pending") == 1
        assert snap.value("gpu_blocks_free") == NUM_GPU - 8
        assert snap.as_dict()['kvmgr_evictions_total{policy="lru"}'] == 3
        with pytest.raises(KeyError):
            snap.value("evictions_total", policy="arc")
        engine.release()


@pytest.mark.asyncio
async def test_prometheus_exposition_on_and_off_the_loop_thread() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    engine = FaultyEngine(HostEngine())
    async with opened(make_kv(13), ManagerConfig(num_cpu_blocks=4), engine) as mgr:
        await _metrics_scene(mgr, engine)
        registry = prometheus_client.CollectorRegistry()
        exporter = PrometheusExporter(mgr, registry=registry, prefix="kv")
        on_loop = prometheus_client.generate_latest(registry).decode()
        # a scrape from another thread (as start_http_server does) reads on the loop thread
        off_loop = (await asyncio.to_thread(prometheus_client.generate_latest, registry)).decode()
        for text in (on_loop, off_loop):
            for line in (
                "# TYPE kv_evictions_total counter",
                'kv_evictions_total{policy="lru"} 3.0',
                'kv_stores_rejected_total{reason="cpu_full"} 1.0',
                "kv_lookup_misses_total 1.0",
                f'kv_transfer_bytes_total{{direction="d2h"}} {6.0 * BLOCK_BYTES}',
                "# TYPE kv_copies_in_flight gauge",
                "kv_copies_in_flight 1.0",
                'kv_cpu_blocks{state="free"} 0.0',
            ):
                assert line in text.splitlines(), line
        with pytest.raises(ValueError):  # the same series twice in one registry
            PrometheusExporter(mgr, registry=registry, prefix="kv")
        exporter.unregister()
        assert prometheus_client.generate_latest(registry) == b""
        engine.release()


def test_metrics_import_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvmgr.metrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    module = importlib.reload(kvmgr.metrics)
    snap = module.metrics_snapshot(ManagerStatistics(lookups=3, lookup_keys=5, lookup_hits=4))
    assert snap.value("lookup_misses_total") == 1
    with pytest.raises(ImportError, match="kvmgr\\[metrics\\]"):
        module.PrometheusExporter(object())  # type: ignore[arg-type]


# ====================================================================== CUDA engines


@pytest.mark.gpu
@pytest.mark.parametrize("engine_name", ["cuda", "kernel"])
@pytest.mark.asyncio
async def test_faults_on_a_cuda_engine(engine_name: str) -> None:
    """A failed, a hung and a good store and their loads, through a CUDA engine."""
    kv = [t.cuda() for t in make_kv(15)]
    config = ManagerConfig(num_cpu_blocks=6, engine=engine_name)
    engine = FaultyEngine(make_engine(engine_name, kv[0].device, config), fail_batches={1})
    async with opened(kv, config, engine) as mgr:
        gpu = mgr.allocate("r", 8)
        expected = [gpu_page(kv, b) for b in gpu]
        good = mgr.swap_out(gpu[:2], KEYS[:2])  # batch 0
        await mgr.step()
        await good
        bad = mgr.swap_out(gpu[2:4], KEYS[2:4])  # batch 1: copied, then failed and poisoned
        await mgr.step()
        with pytest.raises(TransferError, match="injected"):
            await bad
        assert mgr.lookup(KEYS[2:4]) == 0
        check_invariants(mgr)
        engine.hold()
        held = mgr.swap_out(gpu[4:6], KEYS[4:6])  # batch 2: its completion is withheld
        await mgr.step()
        with pytest.raises(TransferTimeoutError):
            await mgr.wait(held, timeout_s=0.05)
        assert mgr.statistics().cpu_keys_pending == 2
        check_invariants(mgr)
        engine.release()
        await held
        load = mgr.swap_in([*KEYS[:2], *KEYS[4:6]], gpu[2:6])  # into blocks the stores read
        await mgr.step()
        await load
        torch.cuda.synchronize()
        for block, source in zip(gpu[2:6], (0, 1, 4, 5)):
            assert same(gpu_page(kv, block), expected[source]), (block, source)
        check_invariants(mgr)
