"""A hypothesis state machine over 2 real rank processes, in lockstep with per-rank references.

Every rule runs the same call on ``OffloadManager.over_ranks`` (2 rank processes, heads split)
and on two single-process managers over each rank's starting tensors (the references). After
every rule: ``check_invariants`` on the scheduler side, and its bookkeeping (keys and their
states, block tables, GPU block states) equals the reference's, as does the outcome of every
call (the value or the error type). At the end of each example every rank's GPU bytes equal
its reference's.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

sys.path.insert(0, str(Path(__file__).parents[1]))  # the rank processes import ranks_support

from ranks_support import make_rank, rank_kv

from kvmgr import KVMgrError, ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants
from kvmgr.transport import RankGroup

SPEC = {"num_gpu_blocks": 12, "num_cpu_blocks": 8, "seed": 3, "layout": "heads"}
CONFIG = ManagerConfig(num_cpu_blocks=8, engine="host")
KEYS = [b"k%02d" % i for i in range(10)]
REQS = ["a", "b", "c"]


class RankMachine(RuleBasedStateMachine):
    """The ranked manager and the references, driven alike."""

    @initialize()
    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.group = RankGroup(2, make_rank, (SPEC,))
        self.kv = [rank_kv(SPEC, rank) for rank in range(2)]
        self.managers = [OffloadManager.over_ranks(self.group, CONFIG)]
        self.managers += [OffloadManager(kv, CONFIG) for kv in self.kv]
        self.pending: list[list[asyncio.Future[Any]]] = [[], [], []]

    def teardown(self) -> None:
        if not hasattr(self, "loop"):
            return
        try:
            self.loop.run_until_complete(self._settle())
            dumps = [self.group.dump(rank).gpu for rank in range(2)]
            for rank in range(2):
                assert dumps[rank] == [t.numpy().tobytes() for t in self.kv[rank]], rank
        finally:
            for mgr in self.managers:
                self.loop.run_until_complete(mgr.aclose(timeout_s=10))
            self.group.close()
            self.loop.close()

    def _all(self, call: Any) -> None:
        """Run ``call(mgr)`` on every manager; the outcomes must agree."""
        outcomes = []
        for i, mgr in enumerate(self.managers):

            async def run(mgr: OffloadManager = mgr) -> Any:
                return call(mgr)

            try:
                value = self.loop.run_until_complete(run())
            except KVMgrError as exc:
                outcomes.append(type(exc))
                continue
            if asyncio.isfuture(value):
                self.pending[i].append(value)
                outcomes.append("future")
            else:
                outcomes.append(value)
        assert outcomes[0] == outcomes[1] == outcomes[2], outcomes
        self._check()

    def _check(self) -> None:
        check_invariants(self.managers[0])
        snaps = [m.snapshot() for m in self.managers[:2]]
        for snap in snaps[1:]:
            assert snaps[0].keys == snap.keys
            assert snaps[0].tables == snap.tables
            assert snaps[0].gpu_states == snap.gpu_states

    async def _settle(self) -> None:
        results = []
        for mgr, futures in zip(self.managers, self.pending):
            await mgr.step()
            got = await asyncio.gather(*futures, return_exceptions=True)
            results.append([type(r) if isinstance(r, BaseException) else "ok" for r in got])
            futures.clear()
        assert results[0] == results[1] == results[2], results

    @rule(req=st.sampled_from(REQS), n=st.integers(1, 4))
    def allocate(self, req: str, n: int) -> None:
        self._all(lambda m: m.allocate(req, n))

    def _tables(self, tier: str) -> list[str]:
        """Requests (of the reference) whose blocks are all in ``tier`` and not moving."""
        tables = self.managers[1].snapshot().tables
        return sorted(
            str(r)
            for r, t in tables.items()
            if t.tier.name == tier and t.block_ids and not t.moving
        )

    @precondition(lambda self: self._tables("GPU"))
    @rule(data=st.data(), start=st.integers(0, 6))
    def store(self, data: st.DataObject, start: int) -> None:
        req = data.draw(st.sampled_from(self._tables("GPU")))

        def call(m: OffloadManager) -> Any:
            blocks = [b for _, b in m.block_table(req)]
            return m.swap_out(blocks, KEYS[start : start + len(blocks)])

        self._all(call)

    @precondition(lambda self: self.managers[1].peek(KEYS[:1]) or self.managers[1].peek(KEYS[3:4]))
    @rule(req=st.sampled_from(REQS), start=st.sampled_from([0, 3]), n=st.integers(1, 3))
    def load(self, req: str, start: int, n: int) -> None:
        def call(m: OffloadManager) -> Any:
            hit = m.lookup(KEYS[start : start + n])
            return m.swap_in(KEYS[start : start + hit], m.allocate(req, hit))

        self._all(call)

    @precondition(lambda self: self._tables("GPU"))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._tables("GPU")))
        self._all(lambda m: m.preempt(req))

    @precondition(lambda self: self._tables("CPU"))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._tables("CPU")))
        self._all(lambda m: m.resume(req))

    @rule(req=st.sampled_from(REQS))
    def free(self, req: str) -> None:
        self._all(lambda m: m.free(req))

    @rule(key=st.sampled_from(KEYS))
    def invalidate(self, key: bytes) -> None:
        self._all(lambda m: m.invalidate([key]))

    @precondition(lambda self: any(self.pending))
    @rule()
    def step(self) -> None:
        self.loop.run_until_complete(self._settle())
        self._check()


RankMachine.TestCase.settings = settings(
    max_examples=8,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRankMachine = pytest.mark.timeout(600)(RankMachine.TestCase)
