"""The futures of recorded per-call stores (``kvmgr.scheduler.fanout``, issue 27): one shared
outcome per settle, one ``CallFuture`` per call, held to ``asyncio.Future``'s behaviour.

Host engine (or ``NullEngine`` where only the bookkeeping matters), CPU tensors of seeded
random bytes; every result is checked against the bytes the copy wrote.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, PoolExhaustedError, SwapResult
from kvmgr.errors import ClosedError, TransferError, TransferTimeoutError
from kvmgr.scheduler.fanout import CallFuture
from kvmgr.testing import FaultyEngine, NullEngine, check_invariants
from kvmgr.transfer import HostEngine

NUM_GPU = 16
K = [hashlib.blake2b(f"f{i}".encode(), digest_size=16).digest() for i in range(64)]


def _kv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (NUM_GPU, 128), dtype=torch.uint8, generator=gen)]


def _cfg(num_cpu_blocks: int = 32) -> ManagerConfig:
    return ManagerConfig(num_cpu_blocks=num_cpu_blocks, engine="host")


def _landed(mgr: OffloadManager, kv: list[torch.Tensor], result: SwapResult) -> bool:
    pool = mgr.cpu_pool.tensors[0]
    pairs = zip(result.gpu_block_ids, result.cpu_block_ids)
    return all(torch.equal(pool[c], kv[0][g]) for g, c in pairs)


@pytest.mark.asyncio
async def test_a_call_future_is_an_asyncio_future_in_behaviour() -> None:
    kv = _kv(1)
    async with OffloadManager(kv, _cfg()) as mgr:
        gpu = mgr.allocate("r", 4)
        one = mgr.swap_out([gpu[0]], [K[0]])
        two = mgr.swap_out(gpu[1:3], K[1:3])  # two blocks: a call of its own in the fan-out
        assert isinstance(one, CallFuture) and asyncio.isfuture(one)
        assert one.get_loop() is asyncio.get_running_loop()
        assert not one.done() and not one.cancelled()
        with pytest.raises(asyncio.InvalidStateError):
            one.result()
        with pytest.raises(asyncio.InvalidStateError):
            one.exception()
        await mgr.step()
        r1, r2 = await one, await two
        assert one.done() and two.done() and one.exception() is None
        assert r1 is one.result()  # built once
        assert (r1.num_blocks, r1.num_bytes, r1.num_skipped) == (1, 128, 0)
        assert (r2.num_blocks, r2.gpu_block_ids) == (2, (gpu[1], gpu[2]))
        assert r1.gpu_block_ids == (gpu[0],) and _landed(mgr, kv, r1) and _landed(mgr, kv, r2)
        assert not one.cancel()  # done: nothing to cancel
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_cancelling_one_awaiting_task_cancels_that_call_only() -> None:
    kv = _kv(2)
    async with OffloadManager(kv, _cfg()) as mgr:
        gpu = mgr.allocate("r", 8)
        calls = [mgr.swap_out([gpu[i]], [K[i]]) for i in range(6)]
        tasks = [asyncio.ensure_future(asyncio.shield(c)) for c in calls[:2]]
        waiting = asyncio.create_task(_await(calls[2]))
        gathered = asyncio.gather(*calls[3:])
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert calls[2].cancelled() and not calls[3].done()
        await mgr.step()
        results = await gathered
        assert [r.gpu_block_ids for r in results] == [(gpu[i],) for i in range(3, 6)]
        assert all(_landed(mgr, kv, r) for r in results)
        assert [(await t).gpu_block_ids for t in tasks] == [(gpu[0],), (gpu[1],)]
        with pytest.raises(asyncio.CancelledError):
            calls[2].result()
        assert mgr.peek([K[2]]) == 1  # its copy ran all the same
        check_invariants(mgr)


async def _await(future: object) -> object:
    return await future  # type: ignore[misc]


@pytest.mark.asyncio
async def test_deadlines_wait_for_cancels_the_call_and_manager_wait_does_not() -> None:
    kv = _kv(3)
    async with OffloadManager(kv, _cfg()) as mgr:
        gpu = mgr.allocate("r", 4)
        timed, shielded = mgr.swap_out([gpu[0]], [K[0]]), mgr.swap_out([gpu[1]], [K[1]])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(timed, 0.01)
        assert timed.cancelled()
        with pytest.raises(TransferTimeoutError):
            await mgr.wait(shielded, 0.01)
        assert not shielded.done()
        await mgr.step()
        result = await mgr.wait(shielded, 5)
        assert _landed(mgr, kv, result) and mgr.peek(K[0:2]) == 2


@pytest.mark.asyncio
async def test_done_callbacks_run_on_the_loop_in_call_order_and_can_be_removed() -> None:
    async with OffloadManager(_kv(4), _cfg(), engine=NullEngine()) as mgr:
        gpu = mgr.allocate("r", 4)
        calls = [mgr.swap_out([gpu[i]], [K[i]]) for i in range(3)]
        seen: list[tuple[str, int]] = []

        def note(name: str, i: int):  # type: ignore[no-untyped-def]
            return lambda f: seen.append((name, f.result().gpu_block_ids[0]))

        drop = note("dropped", 0)
        calls[2].add_done_callback(note("c", 2))
        calls[0].add_done_callback(drop)
        calls[0].add_done_callback(note("a", 0))
        calls[0].add_done_callback(drop)
        assert calls[0].remove_done_callback(drop) == 2 and calls[1].remove_done_callback(drop) == 0
        await mgr.step()
        await asyncio.gather(*calls)
        # Done callbacks are scheduled with call_soon when the calls resolve; Python 3.12's
        # gather may finish at once on futures already done, so yield once to let them run.
        await asyncio.sleep(0)
        assert seen == [("a", gpu[0]), ("c", gpu[2])]  # call order, not registration order
        calls[1].add_done_callback(note("late", 1))  # done: runs soon, once
        assert len(seen) == 2
        await asyncio.sleep(0)
        assert seen[2:] == [("late", gpu[1])]


@pytest.mark.asyncio
async def test_a_failed_batch_fails_every_call_but_a_cancelled_one_stays_cancelled() -> None:
    engine = FaultyEngine(HostEngine(), fail_batches=[0], poison=False)
    async with OffloadManager(_kv(5), _cfg(), engine=engine) as mgr:
        gpu = mgr.allocate("r", 4)
        calls = [mgr.swap_out([gpu[i]], [K[i]]) for i in range(3)]
        calls[1].cancel()
        await mgr.step()
        for call in (calls[0], calls[2]):
            with pytest.raises(TransferError):
                await call
            assert isinstance(call.exception(), TransferError)
        assert calls[1].cancelled()
        assert mgr.peek(K[0:3]) == 0  # dropped: nothing wrong is served
        check_invariants(mgr)
    late = OffloadManager(_kv(5), _cfg())
    async with late:
        orphan = late.swap_out(late.allocate("r", 1), [K[9]])
    with pytest.raises(ClosedError):
        await orphan


@pytest.mark.asyncio
async def test_the_one_by_one_fallback_resolves_each_callers_own_future() -> None:
    kv = _kv(6)
    async with OffloadManager(kv, _cfg(num_cpu_blocks=4)) as mgr:
        gpu = mgr.allocate("r", 8)
        full = mgr.swap_out(gpu[4:8], K[10:14], [None] * 4)  # the tier full: the settle evicts
        await mgr.step()
        await asyncio.wait_for(full, 5)
        calls = [mgr.swap_out([gpu[i]], [K[i]]) for i in range(3)]
        cpu = mgr._books.cpu
        real, refused = cpu.make_room, []

        def refuse(n: int, protected: object) -> object:  # the settle's one eviction for all
            cpu.make_room, _ = real, refused.append(n)  # refuses once: then one by one
            raise PoolExhaustedError("refused", needed=n, available=0, reason="cpu_full")

        cpu.make_room = refuse  # type: ignore[method-assign]
        await mgr.step()
        results = await asyncio.wait_for(asyncio.gather(*calls), 5)
        assert refused == [3]
        assert [r.gpu_block_ids for r in results] == [(gpu[i],) for i in range(3)]
        assert all(_landed(mgr, kv, r) for r in results) and mgr.peek(K[0:3]) == 3
        check_invariants(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("msg", [None, "why"])
async def test_gather_with_return_exceptions_takes_a_cancelled_call(msg: str | None) -> None:
    """``gather(..., return_exceptions=True)`` reads ``_cancel_message`` of a cancelled child;
    a ``CallFuture`` without it raised ``AttributeError`` in gather's callback and the gather
    never resolved. Now its results match those of plain ``asyncio.Future``s."""
    kv = _kv(5)
    async with OffloadManager(kv, _cfg()) as mgr:
        gpu = mgr.allocate("r", 3)
        calls = [mgr.swap_out([gpu[i]], [K[40 + i]]) for i in range(3)]
        plain = [asyncio.get_running_loop().create_future() for _ in range(3)]
        calls[1].cancel(msg)
        plain[1].cancel(msg)
        await mgr.step()
        gathered = asyncio.gather(*calls, return_exceptions=True)
        await asyncio.wait([calls[0], calls[2]], timeout=10)  # the copy ended: all resolved
        for _ in range(10):  # the gather's done callbacks run within a few iterations
            await asyncio.sleep(0)
        assert gathered.done()  # without _cancel_message it never resolves (nor cancels)
        got = gathered.result()
        for i, future in enumerate(plain):
            if not future.done():
                future.set_result(got[i])
        want = await asyncio.gather(*plain, return_exceptions=True)
        assert [type(r) for r in got] == [type(r) for r in want]
        assert isinstance(got[1], asyncio.CancelledError) and got[1].args == want[1].args
        assert _landed(mgr, kv, got[0]) and _landed(mgr, kv, got[2])
        assert mgr.lookup([K[41]]) == 1  # the cancelled call's copy ran all the same
        check_invariants(mgr)
