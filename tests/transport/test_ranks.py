"""Several ranks, one process each (CPU tensors, the host engine, real bytes).

The scheduler side (``OffloadManager.over_ranks``) runs here; each rank process holds its own
KV tensors and CPU tier (``tests/ranks_support.py``). Every scenario runs the same calls on a
single-process ``OffloadManager`` per rank, over that rank's starting tensors, and the bytes of
each rank must equal its reference; ``check_invariants`` runs after every step.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))  # the rank processes import ranks_support

from ranks_support import make_rank, rank_kv

from kvmgr import (
    InvalidArgumentError,
    LayoutMismatchError,
    ManagerConfig,
    OffloadManager,
    PoolExhaustedError,
    RankError,
    RankTimeoutError,
)
from kvmgr.testing import check_invariants
from kvmgr.transport import RankGroup

CONFIG = ManagerConfig(num_cpu_blocks=12, engine="host")
KEYS = [b"key-%02d" % i for i in range(12)]
MLA_KEYS = [b"mla-%02d" % i for i in range(4)]


def _spec(**extra: Any) -> dict[str, Any]:
    return {"num_gpu_blocks": 16, "num_cpu_blocks": 12, "seed": 7, **extra}


async def _step(mgr: OffloadManager, *futures: asyncio.Future[Any]) -> list[Any]:
    await mgr.step()
    results = list(await asyncio.gather(*futures))
    check_invariants(mgr)
    return results


async def _scenario(mgr: OffloadManager) -> None:
    """Store, prefix reuse, load, preempt / resume, batched store and load."""
    a = mgr.allocate("a", 6)
    # 1. store six blocks under a chain of keys
    (stored,) = await _step(mgr, mgr.swap_out(a, KEYS[:6]))
    assert stored.num_blocks == 6
    # 2. prefix reuse: a second request finds the first four READY, loads them
    assert mgr.lookup([*KEYS[:4], b"missing"]) == 4
    b = mgr.allocate("b", 4)
    await _step(mgr, mgr.swap_in(KEYS[:4], b))
    # 3. preempt a, resume it into fresh blocks
    await _step(mgr, mgr.preempt("a"))
    (resumed,) = await _step(mgr, mgr.resume("a"))
    assert len(resumed.gpu_block_ids) == 6
    # 4. one batched store and one batched load in a single step
    c = mgr.allocate("c", 3)
    d = mgr.allocate("d", 2)
    many = mgr.store_many(np.array(c), KEYS[6:9])
    load = mgr.load_many(KEYS[4:6], np.array(d))
    result, _ = await _step(mgr, many, load)
    assert bool(result.stored.all())
    mgr.free("b")


def _reference(spec: dict[str, Any], rank: int) -> list[bytes]:
    """A single-process manager over rank ``rank``'s starting tensors, same calls."""
    kv = rank_kv(spec, rank)

    async def main() -> None:
        async with OffloadManager(kv, CONFIG) as mgr:
            await _scenario(mgr)

    asyncio.run(main())
    return [t.numpy().tobytes() for t in kv]


async def _over_ranks(group: RankGroup, body: Callable[[OffloadManager], Awaitable[None]]) -> None:
    mgr = OffloadManager.over_ranks(group, CONFIG)
    try:
        await body(mgr)
    finally:
        await mgr.aclose(timeout_s=10)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_heads_split_ranks_move_the_bytes_of_a_single_process_reference(num_ranks: int) -> None:
    spec = _spec(layout="heads")
    group = RankGroup(num_ranks, make_rank, (spec,))
    try:
        assert group.geometry.num_ranks == num_ranks
        asyncio.run(_over_ranks(group, _scenario))
        for rank in range(num_ranks):  # each rank's GPU bytes equal its own reference
            assert group.dump(rank).gpu == _reference(spec, rank), f"rank {rank}"
    finally:
        assert group.close() == []


def test_mla_replicated_stores_once_per_block_and_loads_to_every_rank() -> None:
    shm = f"/dev/shm/kvmgr-test-{uuid.uuid4().hex}"
    spec = _spec(layout="replicated", shm=shm)
    group = RankGroup(2, make_rank, (spec,))
    try:
        reports = []

        async def body(mgr: OffloadManager) -> None:
            m = mgr.allocate("m1", 4)
            store = mgr.swap_out(m, MLA_KEYS)
            reports.append(await mgr.step())
            await store
            check_invariants(mgr)
            load = mgr.swap_in(MLA_KEYS, mgr.allocate("m2", 4))
            reports.append(await mgr.step())
            await load
            check_invariants(mgr)
            mgr.free("m1")
            mgr.free("m2")
            await _scenario(mgr)

        asyncio.run(_over_ranks(group, body))
        block_bytes = group.geometry.block_bytes
        # the store was written once per block (by rank cpu_id % 2), the load read by both
        assert reports[0].d2h.bytes == 4 * block_bytes
        assert reports[1].h2d.bytes == 2 * 4 * block_bytes
        dumps = [group.dump(rank) for rank in range(2)]
        assert dumps[0].cpu == dumps[1].cpu  # one shared CPU tier
        assert dumps[0].gpu == dumps[1].gpu  # replicated: identical on every rank
        # and equal to a single process that did the same (its body's first part included)
        kv = rank_kv(spec, 0)

        async def reference() -> None:
            async with OffloadManager(kv, CONFIG) as mgr:
                await _step(mgr, mgr.swap_out(mgr.allocate("m1", 4), MLA_KEYS))
                await _step(mgr, mgr.swap_in(MLA_KEYS, mgr.allocate("m2", 4)))
                mgr.free("m1")
                mgr.free("m2")
                await _scenario(mgr)

        asyncio.run(reference())
        assert dumps[0].gpu == [t.numpy().tobytes() for t in kv]
    finally:
        group.close()
        if os.path.exists(shm):
            os.unlink(shm)


@pytest.mark.parametrize(
    ("args", "options"),
    [
        ((0, make_rank), {}),
        (("2", make_rank), {}),
        ((1.5, make_rank), {}),
        ((True, make_rank), {}),
        ((2, "make_rank"), {}),
        ((2, make_rank), {"deadline_s": -1.0}),
        ((2, make_rank), {"deadline_s": float("nan")}),
        ((2, make_rank), {"start_timeout_s": 0}),
    ],
    ids=[
        "no_ranks",
        "str_ranks",
        "float_ranks",
        "bool_ranks",
        "not_callable",
        "negative_deadline",
        "nan_deadline",
        "zero_start_timeout",
    ],
)
def test_bad_group_arguments_are_typed_and_start_no_process(
    args: tuple[Any, ...], options: dict[str, Any]
) -> None:
    """Found by a new user (round 4): these raised ValueError/TypeError, or were accepted (a
    negative or NaN deadline)."""
    with pytest.raises(InvalidArgumentError):
        RankGroup(*args, (_spec(),), **options)


def test_a_rank_whose_factory_raises_is_reported_with_its_exit_code() -> None:
    """Found by a new user (round 4): the message said "exit code None" (not reaped yet)."""
    with pytest.raises(RankError, match=r"rank 1 did not start \(exit code 1;") as info:
        RankGroup(2, make_rank, (_spec(fault={"rank": 1, "kind": "raise"}),))
    assert info.value.rank == 1


def test_mismatched_layouts_are_refused_at_start() -> None:
    with pytest.raises(LayoutMismatchError) as info:
        RankGroup(2, make_rank, (_spec(bad_rank=1),))
    assert info.value.rank == 1


@pytest.mark.parametrize(
    ("fault", "deadline_s", "error"),
    [
        ({"rank": 1, "kind": "fail"}, None, RankError),  # the rank reports a failure
        ({"rank": 0, "kind": "slow", "delay_s": 3.0}, 0.5, RankTimeoutError),  # past the deadline
    ],
    ids=["fails", "slower_than_the_deadline"],
)
def test_a_rank_that_fails_or_is_late_fails_the_job_on_every_rank(
    fault: dict[str, Any], deadline_s: float | None, error: type[RankError]
) -> None:
    options = {} if deadline_s is None else {"deadline_s": deadline_s}
    group = RankGroup(2, make_rank, (_spec(fault=fault),), **options)
    try:

        async def body(mgr: OffloadManager) -> None:
            store = mgr.swap_out(mgr.allocate("a", 3), KEYS[:3])
            await mgr.step()
            with pytest.raises(error) as info:
                await mgr.wait(store, timeout_s=20)  # a late rank: at the deadline, before 3 s
            assert info.value.rank == fault["rank"]
            assert mgr.lookup(KEYS[:3]) == 0  # never READY: no wrong KV served
            check_invariants(mgr)
            if fault["kind"] == "fail":
                assert mgr.statistics().cpu_blocks_used == 0

        asyncio.run(_over_ranks(group, body))
    finally:
        group.close()


@pytest.mark.parametrize("kind", ["die", "kill"])
def test_a_rank_that_dies_mid_job_turns_the_offload_off(kind: str) -> None:
    fault = (
        {"rank": 1, "kind": "die"} if kind == "die" else {"rank": 1, "kind": "slow", "delay_s": 30}
    )
    group = RankGroup(2, make_rank, (_spec(fault=fault),), deadline_s=60)
    try:

        async def body(mgr: OffloadManager) -> None:
            a = mgr.allocate("a", 3)
            store = mgr.swap_out(a, KEYS[:3])
            await mgr.step()
            if kind == "kill":
                await asyncio.sleep(0.2)  # the rank is inside the job (sleeping in submit)
                group.kill(1)
            with pytest.raises(RankError) as info:
                await mgr.wait(store, timeout_s=20)  # detected by the closed pipe, not a hang
            assert info.value.rank == 1 and not isinstance(info.value, RankTimeoutError)
            assert mgr.lookup(KEYS[:3]) == 0
            check_invariants(mgr)
            # new work fails fast: the offload is off
            later = mgr.swap_out(mgr.allocate("b", 1), KEYS[5:6])
            await mgr.step()
            with pytest.raises(RankError):
                await mgr.wait(later, timeout_s=5)
            check_invariants(mgr)

        asyncio.run(_over_ranks(group, body))
    finally:
        group.close()


def test_the_gpu_blocks_a_late_rank_may_still_write_are_never_handed_out() -> None:
    """A rank past the deadline is alive and may still run its copy: the GPU blocks its late
    load would write are not given to another request (whose KV it would overwrite); the
    load's await fails at the deadline (new user, round 4)."""
    fault = {"rank": 1, "kind": "slow", "delay_s": 2.0, "from_batch": 1}  # the store is on time
    group = RankGroup(2, make_rank, (_spec(fault=fault),), deadline_s=0.5)
    try:

        async def body(mgr: OffloadManager) -> None:
            await _step(mgr, mgr.swap_out(mgr.allocate("a", 3), KEYS[:3]))
            mgr.free("a")
            b = mgr.allocate("b", 3)
            load = mgr.swap_in(KEYS[:3], b)
            await mgr.step()
            with pytest.raises(RankTimeoutError):
                await mgr.wait(load, timeout_s=20)  # at the deadline, before the 2 s copy
            mgr.free("b")
            handed_out: list[int] = []
            with pytest.raises(PoolExhaustedError):
                while True:
                    handed_out += mgr.allocate("c", 1)
            assert not set(handed_out) & set(b)  # rank 1 may still write them

        asyncio.run(_over_ranks(group, body))
    finally:
        group.close()


@pytest.mark.parametrize("when", ["in_the_job", "before_the_send"])
def test_a_rank_that_dies_fails_the_job_only_once_the_live_ranks_answered(when: str) -> None:
    """Rank 1 dies at the load's submit (or is dead when the job is sent to it, the pipe's
    end not seen by the loop yet) while rank 0 is inside the job (sleeping 1.5 s before its
    copy into the load's GPU blocks). The load used to fail at once and its GPU blocks went
    back to the pool, to another request, while rank 0 was about to write them; now it fails
    when rank 0 answered (new user, round 4 session 9)."""
    faults = [{"rank": 0, "kind": "slow", "delay_s": 1.5, "from_batch": 1}]
    if when == "in_the_job":
        faults.append({"rank": 1, "kind": "die", "from_batch": 1})
    group = RankGroup(2, make_rank, (_spec(faults=faults),), deadline_s=30)
    try:

        async def body(mgr: OffloadManager) -> None:
            await _step(mgr, mgr.swap_out(mgr.allocate("a", 3), KEYS[:3]))  # batch 0: on time
            mgr.free("a")
            b = mgr.allocate("b", 3)
            load = mgr.swap_in(KEYS[:3], b)
            if when == "before_the_send":
                group.kill(1)
                group.processes[1].join(5)  # dead; the loop has not read its pipe's end yet
            await mgr.step()
            start = asyncio.get_running_loop().time()
            with pytest.raises(RankError) as info:
                await mgr.wait(load, timeout_s=20)
            assert info.value.rank == 1 and not isinstance(info.value, RankTimeoutError)
            # rank 0 answered first: it slept 1.5 s in its submit, then copied
            assert asyncio.get_running_loop().time() - start > 1.0
            check_invariants(mgr)

        asyncio.run(_over_ranks(group, body))
    finally:
        group.close()
