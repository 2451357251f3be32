"""Every fast path against the general paths, with real bytes (newuser13, round 4 session 11).

One random program of per-call and batched stores (chains of new keys, random keys with
repeats; 1 to 300 keys, so the C passes of more than 8 keys and ``BlockLru.touch_blocks``'s
path of more than 128 run), lookups and loads of READY keys (repeats), frees with copies in
flight, preempts, resumes, invalidations, touches, clears, cancellations and failed batches,
runs twice on a copying engine that completes at submit (the order of completions is fixed):
once as shipped, once with kvmgr's C modules (``_index_c`` and ``_ids_c``), ``add_new``, the
leading run, ``_collect_leaves``, the C ``sort_pairs`` and ``touch_blocks`` turned off. Both
runs must give the same trace (every answer, every error, the keys, states and policy keys at
each quiescent point, with LRU its recency order), and in both every request's GPU blocks hold the bytes of the keys they
stored or loaded (a load's blocks are poisoned first), and every READY key loads back its own
bytes at the end. A refused call must leave the snapshot unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from typing import Any

import numpy as np
import pytest
import torch

import kvmgr._keys as keys_module
import kvmgr.scheduler.block_lru as block_lru
import kvmgr.scheduler.gpu_blocks as gpu_blocks
import kvmgr.scheduler.key_index as key_index
import kvmgr.scheduler.lru_victims as lru_victims
import kvmgr.scheduler.queue as queue_module
import kvmgr.scheduler.store as store
import kvmgr.transfer._runs as runs
from kvmgr import ManagerConfig, OffloadManager, Tier
from kvmgr.errors import KVMgrError
from kvmgr.scheduler.cpu_tier import CpuState
from kvmgr.testing import FaultyEngine, check_invariants
from kvmgr.transfer.engine import BatchHandle
from kvmgr.transfer.host import HostEngine

G, KEYS = 700, [b"key%05d" % i for i in range(900)]


class InlineHost(HostEngine):
    """The host engine's copy run inside ``submit``: completions in a fixed order."""

    def submit(self, plan: Any, *, wait_for: Any = ()) -> BatchHandle:
        batch_id, self._next_batch_id = self._next_batch_id, self._next_batch_id + 1
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(self._run(batch_id, plan))
        return BatchHandle(batch_id, plan.direction, future)


def _val(key: bytes, t: int) -> float:
    return float(int(key[3:]) * 10 + t + 1)


def _full(mgr: OffloadManager) -> Any:
    s = mgr.snapshot()
    return (sorted((k, repr(v)) for k, v in s.keys.items()), tuple(map(int, s.cpu_states)),
            None if s.gpu_states is None else tuple(map(int, s.gpu_states)), dict(s.gpu_busy),
            sorted((repr(k), repr(v)) for k, v in s.tables.items()), len(s.swaps),
            sorted(s.key_parents.items()), sorted(s.policy_keys))  # fmt: skip


class _Run:
    def __init__(self, mgr: OffloadManager, kv: list[torch.Tensor], rng: random.Random) -> None:
        self.mgr, self.kv, self.rng = mgr, kv, rng
        self.futures: list[Any] = []
        self.want: dict[str, list[bytes | None]] = {}  # request -> key per block (None: unknown)
        self.taint: dict[Any, str] = {}  # a future whose failure leaves its request unknown
        self.trace: list[Any] = []
        self.rid = 0

    def fill(self, blocks: list[int], keys: list[bytes]) -> None:
        for t, x in enumerate(self.kv):
            x[torch.tensor(blocks)] = torch.tensor([_val(k, t) for k in keys]).view(-1, 1, 1)

    async def quiesce(self) -> None:
        mgr = self.mgr
        for _ in range(50):
            await mgr.step()
            s = mgr.snapshot()
            if all(f.done() for f in self.futures) and not s.swaps and not s.batches:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("not quiescent")
        for future, req in list(self.taint.items()):
            if (future.cancelled() or future.exception() is not None) and req in self.want:
                self.want[req] = [None] * len(self.want[req])
            del self.taint[future]
        self.futures = []

    def verify(self) -> None:
        for req, keys in self.want.items():
            table = self.mgr.block_table(req)
            if any(tier is not Tier.GPU for tier, _ in table):
                continue
            for (_, b), k in zip(table, keys):
                for t, x in enumerate(self.kv):
                    assert k is None or bool((x[b] == _val(k, t)).all()), (req, b, k)

    def size(self) -> int:
        return self.rng.choice([1, 3, 8, 9, 20, 64, 129, 200, 300])

    def store(self) -> Any:
        mgr, rng = self.mgr, self.rng
        n = min(self.size(), mgr.config.num_cpu_blocks)
        start = rng.randrange(len(KEYS) - n)
        keys = KEYS[start : start + n] if rng.random() < 0.5 else rng.choices(KEYS, k=n)
        self.rid += 1
        req = f"s{self.rid}"
        blocks = mgr.allocate(req, n)
        self.fill(blocks, keys)
        self.want[req] = list(keys)
        how = rng.random()
        before = _full(mgr)
        if how < 0.2:
            return before, mgr.swap_out(list(blocks), list(keys))
        if how < 0.5:
            return before, mgr.store_many(np.array(blocks, dtype=np.int64), tuple(keys))
        parents = [None, *keys[:-1]] if rng.random() < 0.5 else [None] * n
        return before, mgr.store_many(blocks, keys, parents=parents)

    def load(self) -> Any:
        mgr, rng = self.mgr, self.rng
        ready = sorted(k for k, v in mgr.snapshot().keys.items() if v.state is CpuState.READY)
        if not ready:
            return None, None
        n = min(self.size(), len(ready))
        keys = rng.sample(ready, n) if rng.random() < 0.5 else rng.choices(ready, k=n)
        self.trace.append(("hits", mgr.lookup(keys) if rng.random() < 0.5 else mgr.peek(keys)))
        self.rid += 1
        req = f"l{self.rid}"
        blocks = mgr.allocate(req, n)
        for x in self.kv:
            x[torch.tensor(blocks)] = -7.0  # poison: a load that copies nothing is caught
        self.want[req] = list(keys)
        before = _full(mgr)
        if rng.random() < 0.6:
            future = mgr.load_many(keys, np.array(blocks))
        else:
            future = mgr.swap_in(keys, blocks)
        self.taint[future] = req
        return before, future

    def on_request(self, op: str) -> Any:
        mgr, req = self.mgr, self.rng.choice(sorted(self.want))
        before = _full(mgr)
        if op == "free":
            mgr.free(req)
            del self.want[req]
            return before, None
        future = mgr.preempt(req) if op == "preempt" else mgr.resume(req)
        self.taint[future] = req
        return before, future

    async def op(self, i: int) -> None:
        mgr, rng, p = self.mgr, self.rng, self.rng.random()
        before = future = None
        try:
            if p < 0.25:
                before, future = self.store()
            elif p < 0.45:
                before, future = self.load()
            elif p < 0.6:
                await mgr.step()
                if rng.random() < 0.6:
                    await self.quiesce()
                    self.verify()
                    check_invariants(mgr)
                    s = mgr.snapshot()
                    order = getattr(mgr.policy, "ordered_keys", None)  # lru: the recency order
                    self.trace.append((sorted((k, v.state.name) for k, v in s.keys.items()),
                                       sorted(s.policy_keys), order and order()))  # fmt: skip
            elif p < 0.66 and self.futures:
                rng.choice(self.futures).cancel()
            elif p < 0.84 and self.want:
                before, future = self.on_request("free" if p < 0.74 else "preempt" if p < 0.79 else "resume")  # fmt: skip
            elif p < 0.88:
                before = _full(mgr)
                self.trace.append(("invalidated", mgr.invalidate(rng.sample(KEYS, self.size()))))
            elif p < 0.93:
                mgr.touch(rng.sample(KEYS, self.size()))
            elif p < 0.95:
                self.trace.append(("cleared", mgr.clear()))
        except KVMgrError as exc:
            self.trace.append((i, type(exc).__name__))
            assert before is None or _full(mgr) == before, f"op {i}: a refused call changed state"
        if future is not None:
            self.futures.append(future)
        s = mgr.snapshot()
        if s.gpu_allocated is not None and len(s.gpu_allocated) > G - 320:
            for req in sorted(self.want)[: max(1, len(self.want) // 2)]:
                try:
                    mgr.free(req)
                except KVMgrError as exc:  # moving: BlockStateError
                    self.trace.append(("free", type(exc).__name__))
                    continue
                del self.want[req]

    async def read_back(self) -> None:
        """Free everything, then load every READY key (200 a call) and check its bytes."""
        mgr = self.mgr
        await self.quiesce()
        for req in sorted(self.want):
            mgr.free(req)
        self.want.clear()
        ready = sorted(k for k, v in mgr.snapshot().keys.items() if v.state is CpuState.READY)
        for j in range(0, len(ready), 200):
            part = ready[j : j + 200]
            blocks = mgr.allocate("final", len(part))
            for x in self.kv:
                x[torch.tensor(blocks)] = -7.0
            self.want["final"] = list(part)
            self.futures.append(mgr.load_many(part, blocks))
            self.taint[self.futures[-1]] = "final"
            await self.quiesce()
            self.verify()  # (a failed load with faults on: its blocks unknown, not checked)
            mgr.free("final")
            del self.want["final"]
        self.trace.append(("final", ready, sorted(mgr.snapshot().policy_keys)))


async def _program(seed: int, cpu_blocks: int, policy: str, *, faults: bool) -> list[Any]:
    rng = random.Random(seed)
    kv = [torch.zeros(G, 2, 2) for _ in range(2)]
    config = ManagerConfig(num_cpu_blocks=cpu_blocks, policy=policy)
    engine: Any = InlineHost()
    if faults:
        engine = FaultyEngine(engine, fail_rate=0.1, seed=seed)
    async with OffloadManager(kv, config, engine=engine) as mgr:
        run = _Run(mgr, kv, rng)
        for i in range(80):
            await run.op(i)
        await run.quiesce()
        run.verify()
        check_invariants(mgr)
        await run.read_back()
    return run.trace


def _general_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (keys_module, gpu_blocks, key_index, block_lru, store):
        monkeypatch.setattr(module, "index_c", lambda: None)
    for module in (gpu_blocks, queue_module, block_lru, lru_victims, store):
        monkeypatch.setattr(module, "ids_c", lambda: None)
    monkeypatch.setattr(store, "add_new", lambda *args, **kwargs: None)
    monkeypatch.setattr(lru_victims.VictimSearch, "_leading_run", lambda self, n, g: (None, False))
    monkeypatch.setattr(runs, "sort_pairs", lambda: None)

    def collect_loop(self: Any, n: int, guarded: set[int]) -> list[int] | None:
        always = self._can_evict
        return lru_victims.VictimSearch._collect(self, n, lambda key: always(key), guarded)

    monkeypatch.setattr(lru_victims.VictimSearch, "_collect_leaves", collect_loop)
    monkeypatch.setattr(block_lru.BlockLru, "touch_blocks", lambda self, keys, b: self.touch(keys))


CASES = [(0, 400, "lru", False), (1, 150, "lru", False), (2, 400, "lru", True),
         (3, 40, "lru", False), (4, 150, "arc", True), (5, 400, "s3fifo", False)]  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize(("seed", "cpu_blocks", "policy", "faults"), CASES)
async def test_fast_and_general_paths_give_one_trace_and_the_stored_bytes(
    seed: int, cpu_blocks: int, policy: str, faults: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = await _program(seed, cpu_blocks, policy, faults=faults)
    _general_paths(monkeypatch)
    general = await _program(seed, cpu_blocks, policy, faults=faults)
    assert len(fast) > 20
    for i, (a, b) in enumerate(zip(fast, general, strict=True)):
        assert a == b, f"trace entry {i} differs"
