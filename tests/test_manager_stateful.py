"""Hypothesis state machine driving OffloadManager on the host engine with real CPU tensors.

Rules: requests (allocate, write, preempt, resume, free), keyed stores out of request blocks,
loads of READY keys into request blocks, a load and a store of one block back to back, lookups,
steps, engine progress, cancellations of awaiting tasks, injected batch failures, and a drain.

The engine holds submitted batches until a ``progress`` rule runs them, in order, on a real
``HostEngine``: every state change happens inside a rule, so hypothesis can replay and shrink.

The model is logical: ``req_data[req][i]`` is what logical block ``i`` of request ``req`` must
hold, ``key_data[key]`` what the CPU tier must hold under ``key``, each as ``(bytes, deps)``:
``deps`` are the loads (since the last drain) the value came through. At a drain, values that
depend on a failed load become unknown (``None``); a cancelled load counts as failed only if a
failure was injected since the last drain. Swaps apply to the model in call order: a store and a
load of one GPU block queued in one step must behave as if run in that order.

After every rule: block accounting (no leaks), index == policy == model keys, nothing reported
to the loop's exception handler. After every drain: no readers, nothing PENDING, and every
resident request's GPU pages, swapped-out request's CPU pages and key's CPU pages hold exactly
the model's bytes.

Default profile ``kvmgr-ci`` runs in ~10 s; more:
``HYPOTHESIS_PROFILE=kvmgr-long python -m pytest tests/test_manager_stateful.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvmgr.pool.prefix_index import BlockState

from kvmgr import ManagerConfig, OffloadManager, PoolExhaustedError, Tier, TransferError
from kvmgr.transfer import HostEngine
from kvmgr.transfer.engine import BatchHandle, BatchResult, EngineStatistics, TransferEngine
from kvmgr.transfer.plan import TransferPlan

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
settings.register_profile("kvmgr-ci", max_examples=100, stateful_step_count=40, **_COMMON)
settings.register_profile("kvmgr-long", max_examples=3000, stateful_step_count=80, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "kvmgr-ci")
if PROFILE not in ("kvmgr-ci", "kvmgr-long"):  # another project profile: keep ours
    PROFILE = "kvmgr-ci"

NUM_GPU, NUM_CPU, MAX_REQUESTS = 10, 6, 4
KEYS = [bytes([0x40 + i]) * 8 for i in range(8)]
Value = tuple[bytes | None, frozenset[int]]  # expected bytes (None: unknown), loads it came through
NO_DEPS: frozenset[int] = frozenset()


class _SteppedHostEngine(TransferEngine):
    """Holds submitted batches until ``progress`` runs the oldest on a real ``HostEngine`` (worker
    thread, memmove) and resolves them in order; a batch marked failed resolves with
    ``TransferError`` without copying."""

    name = "stepped-host"

    def __init__(self) -> None:
        self.inner = HostEngine()
        self.num_failed = 0
        self.held: list[tuple[TransferPlan, bool, concurrent.futures.Future[BatchResult]]] = []

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        return self.inner.allocate_host(num_bytes)

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
        self.held.append((plan, False, future))
        return BatchHandle(len(self.held), plan.direction, future)

    def mark_failed(self, i: int) -> None:
        plan, _, future = self.held[i]
        self.held[i] = (plan, True, future)
        self.num_failed += 1

    async def progress(self, num_batches: int | None = None) -> None:
        """Run (or fail) the oldest held batches, then let the manager see their completion."""
        count = len(self.held) if num_batches is None else num_batches
        batches, self.held = self.held[:count], self.held[count:]
        for plan, fail, future in batches:
            if fail:
                future.set_exception(TransferError("injected failure"))
            else:
                future.set_result(await asyncio.wrap_future(self.inner.submit(plan).future))
        for _ in range(5):  # completion -> bookkeeping -> futures -> awaiting tasks
            await asyncio.sleep(0)

    def close(self, timeout_s: float | None = None) -> None:
        for _, _, future in self.held:
            future.set_exception(TransferError("engine closed"))
        self.held.clear()
        self.inner.close(timeout_s)

    def statistics(self) -> EngineStatistics:
        return self.inner.statistics()


def _kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    kv_pair = torch.randn(NUM_GPU, 2, 3, 5, generator=gen)
    return [
        torch.randint(1, 256, (NUM_GPU, 584), dtype=torch.uint8, generator=gen),
        torch.randn(NUM_GPU, 2, 288, generator=gen).to(torch.bfloat16),
        kv_pair[:, 0],  # non-dense K half: 60 B pages, 120 B apart
    ]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.leaked: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.leaked.append(context))
        self.kv = _kv()
        self.engine = _SteppedHostEngine()
        self.mgr: OffloadManager | None = None
        self.req_data: dict[str, list[Value]] = {}
        self.key_data: dict[bytes, Value] = {}
        self.tasks: list[asyncio.Task[Any]] = []
        self.loads: list[asyncio.Task[Any]] = []  # load id = position, since the last drain
        self.next_req = 0

    # ------------------------------------------------------------------ helpers

    def _run(self, coro: Any) -> Any:
        """Run on the machine's loop; completions processed meanwhile may drop failed keys."""
        try:
            return self.loop.run_until_complete(coro)
        finally:
            if self.mgr is not None:
                self.key_data = {k: v for k, v in self.key_data.items() if k in self.mgr.index}

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a sync manager method inside the loop (swaps need a running loop)."""

        async def call() -> Any:
            return fn(*args)

        return self._run(call())

    def _track(self, future: asyncio.Future[Any]) -> asyncio.Task[Any]:
        async def awaiter() -> Any:
            return await future

        task = self.loop.create_task(awaiter())
        self.tasks.append(task)
        return task

    def _table(self, req: str) -> Any:
        assert self.mgr is not None
        return self.mgr._tables[req]  # private: the moving flag has no public accessor

    def _requests(self, tier: Tier) -> list[str]:
        """Requests in ``tier`` with no preempt or resume in flight."""
        return sorted(
            r for r in self.req_data if not self._table(r).moving and self._table(r).tier is tier
        )

    def _ready(self) -> list[bytes]:
        return sorted(k for k in self.mgr.index if self.mgr.index.is_ready(k)) if self.mgr else []

    def _idle(self) -> bool:
        stats = self.mgr.statistics() if self.mgr else None
        return stats is not None and stats.queued_swaps == 0 and stats.batches_in_flight == 0

    def _gpu_page(self, b: int) -> bytes:
        return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in self.kv)

    def _cpu_page(self, c: int) -> bytes:
        assert self.mgr is not None
        return b"".join(t[c].numpy().tobytes() for t in self.mgr.cpu_pool.tensors)

    def _write(self, b: int, seed: int) -> Value:
        gen = torch.Generator().manual_seed(seed)
        for t in self.kv:
            page = t[b].view(torch.uint8)
            page.copy_(torch.randint(1, 256, page.shape, dtype=torch.uint8, generator=gen))
        return self._gpu_page(b), NO_DEPS

    def _state(self) -> Any:
        assert self.mgr is not None
        m = self.mgr
        index = {k: (e.block_id, e.state, e.readers) for k in m.index for e in [m.index.entry(k)]}
        tables = {r: (m.block_table(r), self._table(r).moving) for r in self.req_data}
        gpu_free = None if m.gpu_blocks is None else m.gpu_blocks.num_free
        return index, tables, m.cpu_blocks.num_free, gpu_free, m.statistics().queued_swaps

    def _new_request(self, n: int, seed: int) -> None:
        assert self.mgr is not None and self.mgr.gpu_blocks is not None
        req = f"r{self.next_req}"
        if n > self.mgr.gpu_blocks.num_free:
            before = self._state()
            with pytest.raises(PoolExhaustedError):
                self.mgr.allocate(req, n)
            assert self._state() == before
            return
        self.next_req += 1
        ids = self.mgr.allocate(req, n)
        self.req_data[req] = [self._write(b, seed + i) for i, b in enumerate(ids)]

    def _store(self, req: str, idxs: list[int], keys: list[bytes]) -> None:
        assert self.mgr is not None
        gpu = [self._table(req).block_ids[i] for i in idxs]
        fresh = [(k, i) for k, i in zip(keys, idxs) if k not in self.mgr.index]
        before = self._state()
        try:
            future = self._call(self.mgr.swap_out, gpu, keys)
        except PoolExhaustedError:
            assert self._state() == before
            return
        for key, i in fresh:
            self.key_data[key] = self.req_data[req][i]
        self._track(future)

    def _load(self, req: str, idxs: list[int], keys: list[bytes]) -> None:
        assert self.mgr is not None
        if not all(self.mgr.index.is_ready(k) for k in keys):  # a store just evicted one
            return
        gpu = [self._table(req).block_ids[i] for i in idxs]
        self.loads.append(self._track(self._call(self.mgr.swap_in, keys, gpu)))
        load_id = len(self.loads) - 1
        for key, i in zip(keys, idxs):
            data_bytes, deps = self.key_data[key]
            self.req_data[req][i] = (data_bytes, deps | {load_id})

    def _indices(self, data: st.DataObject, req: str) -> list[int]:
        n = len(self.req_data[req])
        return data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))

    # ------------------------------------------------------------------ rules

    @initialize(
        policy=st.sampled_from(["lru", "arc"]), merge=st.booleans(), seed=st.integers(0, 99)
    )
    def open_manager(self, policy: str, merge: bool, seed: int) -> None:
        cfg = ManagerConfig(num_cpu_blocks=NUM_CPU, policy=policy, engine="host", merge=merge)
        self.mgr = OffloadManager(self.kv, cfg, engine=self.engine)
        self._run(self.mgr.__aenter__())
        # start with two resident requests and three READY keys, so every rule has work
        self._new_request(3, seed)
        self._new_request(2, seed + 10)
        self._store("r0", [0, 1, 2], KEYS[:3])
        self._run(self.mgr.step())
        self._run(self.engine.progress())

    @precondition(lambda self: len(self.req_data) < MAX_REQUESTS)
    @rule(n=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
    def new_request(self, n: int, seed: int) -> None:
        """Allocate and write: a free GPU block is never one a copy still reads or writes."""
        self._new_request(n, seed)

    @precondition(lambda self: self._idle() and self._requests(Tier.GPU))
    @rule(data=st.data(), seed=st.integers(0, 2**31 - 1))
    def write_block(self, data: st.DataObject, seed: int) -> None:
        """Compute writes a block: only when no swap touches it (here: when idle)."""
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        i = data.draw(st.integers(0, len(self.req_data[req]) - 1))
        self.req_data[req][i] = self._write(self._table(req).block_ids[i], seed)

    @precondition(lambda self: self._requests(Tier.GPU))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        idxs = self._indices(data, req)
        keys = data.draw(
            st.lists(st.sampled_from(KEYS), min_size=len(idxs), max_size=len(idxs), unique=True)
        )
        self._store(req, idxs, keys)

    @precondition(lambda self: self._requests(Tier.GPU) and self._ready())
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        idxs = self._indices(data, req)
        keys = data.draw(
            st.lists(st.sampled_from(self._ready()), min_size=len(idxs), max_size=len(idxs))
        )
        self._load(req, idxs, keys)

    @precondition(lambda self: self._requests(Tier.GPU) and self._ready())
    @rule(data=st.data(), store_first=st.booleans())
    def load_and_store_one_block(self, data: st.DataObject, store_first: bool) -> None:
        """A load into a block and a store of that block, back to back: the hazard case."""
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        i = data.draw(st.integers(0, len(self.req_data[req]) - 1))
        load_key = data.draw(st.sampled_from(self._ready()))
        store_key = data.draw(st.sampled_from([k for k in KEYS if k not in self.mgr.index] or KEYS))
        if store_first:
            self._store(req, [i], [store_key])
        self._load(req, [i], [load_key])
        if not store_first:
            self._store(req, [i], [store_key])

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def lookup(self, keys: list[bytes]) -> None:
        assert self.mgr is not None
        hits = self.mgr.lookup(keys)
        expected = 0
        for key in keys:
            if not self.mgr.index.is_ready(key):
                break
            expected += 1
        assert hits == expected

    @precondition(lambda self: self._requests(Tier.GPU))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        before = self._state()
        try:
            self._track(self._call(self.mgr.preempt, req))
        except PoolExhaustedError:
            assert self._state() == before

    @precondition(lambda self: self._requests(Tier.CPU))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._requests(Tier.CPU)))
        before = self._state()
        try:
            self._track(self._call(self.mgr.resume, req))
        except PoolExhaustedError:
            assert self._state() == before

    def _freeable(self) -> list[str]:
        # any request without a preempt/resume in flight, even while stores read its blocks
        return self._requests(Tier.CPU) + self._requests(Tier.GPU)

    @precondition(lambda self: self._freeable())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._freeable()))
        self.mgr.free(req)
        del self.req_data[req]

    @rule(then=st.sampled_from(["nothing", "one batch", "everything"]))
    def step(self, then: str) -> None:
        assert self.mgr is not None
        queued = self.mgr.statistics().queued_swaps
        report = self._run(self.mgr.step())
        assert report.d2h.swaps + report.h2d.swaps == queued
        assert (report.d2h.batches > 0) == (report.d2h.swaps > 0)
        assert (report.h2d.batches > 0) == (report.h2d.swaps > 0)
        if then != "nothing":
            self._run(self.engine.progress(1 if then == "one batch" else None))

    @precondition(lambda self: self.engine.held)
    @rule(num_batches=st.integers(1, 3))
    def progress(self, num_batches: int) -> None:
        self._run(self.engine.progress(num_batches))

    @precondition(lambda self: self.engine.held)
    @rule(data=st.data())
    def fail_a_held_batch(self, data: st.DataObject) -> None:
        self.engine.mark_failed(data.draw(st.integers(0, len(self.engine.held) - 1)))

    @precondition(lambda self: any(not t.done() for t in self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from([t for t in self.tasks if not t.done()])).cancel()
        self._run(asyncio.sleep(0))

    @rule()
    def drain(self) -> None:
        self._run(self._drain())
        self._check_data()

    async def _drain(self) -> None:
        assert self.mgr is not None
        await self.mgr.step()
        await self.engine.progress()
        if self.tasks:  # bounded: a swap whose future never resolves must fail, not hang
            _, never_resolved = await asyncio.wait(self.tasks, timeout=10)
            assert not never_resolved, f"{len(never_resolved)} swaps never resolved"
            for task in self.tasks:  # retrieve failures (a failed swap is expected here)
                if not task.cancelled():
                    task.exception()
        assert self._idle()
        for key in self.mgr.index:  # nothing in flight: no reader, nothing PENDING
            entry = self.mgr.index.entry(key)
            assert (entry.state, entry.readers) == (BlockState.READY, 0), key.hex()
        failed = {
            load_id
            for load_id, task in enumerate(self.loads)
            if (task.cancelled() and self.engine.num_failed)
            or (not task.cancelled() and task.exception() is not None)
        }

        def settle(value: Value) -> Value:
            return (None if value[1] & failed else value[0], NO_DEPS)

        self.req_data = {r: [settle(v) for v in values] for r, values in self.req_data.items()}
        self.key_data = {k: settle(v) for k, v in self.key_data.items() if k in self.mgr.index}
        self.tasks, self.loads, self.engine.num_failed = [], [], 0

    async def _cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _check_data(self) -> None:
        assert self.mgr is not None
        for req, expected in self.req_data.items():
            table = self._table(req)
            page = self._gpu_page if table.tier is Tier.GPU else self._cpu_page
            for i, (b, (want, _)) in enumerate(zip(table.block_ids, expected)):
                if want is not None:
                    assert page(b) == want, f"request {req} block {i} ({table.tier}, {b})"
        for key, (want, _) in self.key_data.items():
            if want is not None:
                assert self._cpu_page(self.mgr.index.entry(key).block_id) == want, key.hex()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def no_block_leaks(self) -> None:
        if self.mgr is None:
            return
        m = self.mgr
        tables = [self._table(r) for r in self.req_data]
        assert set(m._tables) == set(self.req_data)
        cpu_held = sum(len(t.block_ids) for t in tables if t.tier is Tier.CPU or t.moving)
        assert m.cpu_blocks.num_allocated == len(m.index) + cpu_held
        gpu_held = sum(len(t.block_ids) for t in tables if t.tier is Tier.GPU or t.moving)
        deferred = len(m._gpu_free_deferred)  # private: freed owned blocks a copy still uses
        assert m.gpu_blocks is not None and m.gpu_blocks.num_allocated == gpu_held + deferred
        if self._idle():
            assert deferred == 0
        stats = m.statistics()
        assert stats.cpu_keys_pending + stats.cpu_keys_ready == len(m.index)
        assert stats.cpu_blocks_used == m.cpu_blocks.num_allocated

    @invariant()
    def index_policy_and_model_agree(self) -> None:
        if self.mgr is None:
            return
        keys = set(self.mgr.index)
        assert len(self.mgr.policy) == len(keys)
        assert all(k in self.mgr.policy for k in keys)
        assert set(self.key_data) == keys

    @invariant()
    def nothing_leaked_into_the_loop(self) -> None:
        assert self.leaked == []

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                try:
                    self._run(self._drain())
                    self._check_data()
                finally:
                    self._run(self.mgr.aclose(timeout_s=5))
                    self._run(self._cancel_tasks())
            else:
                self.engine.close()
            assert self.leaked == []
        finally:
            self.loop.close()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings.get_profile(PROFILE)
