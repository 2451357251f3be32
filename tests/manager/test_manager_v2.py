"""Manager core v2 (issue 11): what the redesign added or changed, on the host engine.

1. GPU block ownership: the issue's repro (a swap of a block nobody holds), both sides, and the
   README round trip written with ``allocate``, ``check_invariants`` after every step.
2. ``resize_()``/``set_()`` of a KV tensor after construction: the next flush fails its batches
   with ``StaleKVTensorError`` and nothing is served.
3. The batched API: ``store_many``/``load_many`` array results, parents, one future per call,
   mixed with per-call swaps in one step.
4. ``peek`` (touches nothing), ``touch``, ``invalidate``, ``clear``.
5. KV events: order (a removal before the store that caused it), ``take_events``, the async
   iterator, the bounded stream and ``events_dropped``.
6. ``store_threshold``: admission after N sightings, ``stores_not_admitted``.
7. The typed errors of the issue's section 5.
8. ``NullEngine``: completes at once, or holds batches until told.

KV tensors are CPU tensors of seeded random data (never zeros); load destinations are poisoned
first. Keyed scenarios hand every GPU block to a "serving" request first (``_hold``), since an
owned pool lets a swap name only held blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import torch
from test_manager import _roots, _swapped_out

import kvmgr.errors
from kvmgr import (
    BlockStateError,
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    KVMgrError,
    ManagerConfig,
    OffloadManager,
    PoolExhaustedError,
    SwapResult,
    TransferError,
    TransferTimeoutError,
)
from kvmgr.errors import (
    ClosedBeforeCopyError,
    EventLoopError,
    HostMemoryError,
    StaleKVTensorError,
)
from kvmgr.manager import CpuState, GpuState
from kvmgr.reports import KVEvent, LoadResult, StoreResult
from kvmgr.testing import NullEngine, ScriptedEngine, check_invariants
from kvmgr.transfer import HostEngine
from kvmgr.transfer.plan import TransferPlan

NUM_GPU = 16
K = [hashlib.blake2b(f"key{i}".encode(), digest_size=16).digest() for i in range(32)]
POISON = 0xA5


def _kv(seed: int = 0, num_blocks: int = NUM_GPU) -> list[torch.Tensor]:
    """Two KV tensors of random bytes: 584 B and 1152 B pages."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 256, (num_blocks, 584), dtype=torch.uint8, generator=gen),
        torch.randn(num_blocks, 2, 288, generator=gen).to(torch.bfloat16),
    ]


BLOCK_BYTES = 584 + 1152


def _gpu(kv: list[torch.Tensor], b: int) -> bytes:
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in kv)


def _cpu(mgr: OffloadManager, c: int) -> bytes:
    return b"".join(t[c].numpy().tobytes() for t in mgr.cpu_pool.tensors)


def _poison(kv: list[torch.Tensor], b: int) -> bytes:
    for t in kv:
        t[b].view(torch.uint8).fill_(POISON)
    return _gpu(kv, b)


def _cfg(num_cpu_blocks: int = 8, **kw: Any) -> ManagerConfig:
    return ManagerConfig(num_cpu_blocks=num_cpu_blocks, engine="host", **kw)


def _hold(mgr: OffloadManager, n: int = NUM_GPU) -> list[int]:
    """A "serving" request holds the first ``n`` GPU blocks (fresh ids, in order)."""
    held = mgr.allocate("serving", n)
    assert held == list(range(n))
    return held


@contextlib.asynccontextmanager
async def _serving(*args: Any, **kw: Any) -> AsyncIterator[OffloadManager]:
    """``OffloadManager(*args, **kw)``, open, with every GPU block held by a "serving"
    request (``_hold``)."""
    async with OffloadManager(*args, **kw) as mgr:
        _hold(mgr)
        yield mgr


async def _settle() -> None:
    """Let completion callbacks scheduled from the engine run on the loop."""
    for _ in range(3):
        await asyncio.sleep(0)


# ====================================================================== 1. ownership


@pytest.mark.asyncio
async def test_issue_repro_a_store_of_a_block_nobody_holds_is_refused() -> None:
    # the repro of issue 11 section 1, on random data
    kv = [torch.randn(8, 64, generator=torch.Generator().manual_seed(11))]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8)) as mgr:
        before = mgr.snapshot()
        with pytest.raises(InvalidBlockError, match="not held"):
            mgr.swap_out([0], [b"A"])  # block 0 was never allocated
        assert mgr.snapshot() == before  # nothing changed: no key, no swap, no CPU block
        assert mgr.statistics().stores_queued == 0
        # the same through the batched API
        with pytest.raises(InvalidBlockError):
            mgr.store_many(np.array([0]), [b"A"])
        assert mgr.snapshot() == before
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_issue_repro_written_correctly_serves_the_right_bytes() -> None:
    # the repro with allocate(): B can no longer be handed the block A's store reads
    kv = [torch.randn(8, 64, generator=torch.Generator().manual_seed(12))]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8)) as mgr:
        a = mgr.allocate("A", 1)
        assert a == [0]
        a_bytes = kv[0][0].clone()
        st = mgr.swap_out(a, [b"A"])
        mgr.free("A")  # A is done with block 0 while its store is still queued
        check_invariants(mgr)
        snap = mgr.snapshot()
        assert snap.gpu_states is not None and snap.gpu_states[0] is GpuState.DRAINING
        b = mgr.allocate("B", 1)
        assert b != [0]  # block 0 is still read by the queued store
        with pytest.raises(PoolExhaustedError):
            mgr.allocate("C", 7)  # 6 free: block 0 is not among them
        kv[0][b[0]].copy_(torch.randn(64, generator=torch.Generator().manual_seed(13)))
        await mgr.step()
        await st
        check_invariants(mgr)
        assert mgr.statistics().gpu_blocks_free == 7  # block 0 went back when the copy ended
        dst = mgr.allocate("D", 1)
        kv[0][dst[0]].fill_(-7.0)
        ld = mgr.swap_in([b"A"], dst)
        await mgr.step()
        await ld
        assert torch.equal(kv[0][dst[0]], a_bytes)  # key A serves A's bytes
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_load_side_hole_a_load_into_a_block_nobody_holds_is_refused() -> None:
    kv = _kv(seed=1)
    async with OffloadManager(kv, _cfg()) as mgr:
        src = mgr.allocate("r", 1)
        await _swapped_out(mgr, src, [K[0]])
        before = mgr.snapshot()
        with pytest.raises(InvalidBlockError, match="not held"):
            mgr.swap_in([K[0]], [5])  # block 5 is free: allocate() could hand it out mid-load
        with pytest.raises(InvalidBlockError):
            mgr.load_many([K[0]], np.array([5]))
        assert mgr.snapshot() == before
        assert mgr.snapshot().keys[K[0]].readers == 0
        # a load into a held block, freed while the load is queued: the block drains first
        dst = mgr.allocate("s", 1)
        _poison(kv, dst[0])
        ld = mgr.swap_in([K[0]], dst)
        mgr.free("s")
        assert mgr.snapshot().gpu_states[dst[0]] is GpuState.DRAINING  # type: ignore[index]
        other = mgr.allocate("t", NUM_GPU - 2)
        assert dst[0] not in other
        check_invariants(mgr)
        await mgr.step()
        await ld
        assert _gpu(kv, dst[0]) == _gpu(kv, src[0])
        assert mgr.allocate("u", 1) == dst  # back in the pool once the load ended
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_caller_owned_blocks_may_be_named_freely() -> None:
    # manage_gpu_blocks=False: the caller owns every block, any id in range may be swapped
    kv = _kv(seed=2)
    async with OffloadManager(kv, _cfg(manage_gpu_blocks=False)) as mgr:
        await _swapped_out(mgr, [3], [K[0]])
        _poison(kv, 9)
        ld = mgr.swap_in([K[0]], [9])
        await mgr.step()
        await ld
        assert _gpu(kv, 9) == _gpu(kv, 3)
        assert mgr.statistics().gpu_blocks_free is None and mgr.snapshot().gpu_states is None
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_the_readme_round_trip_as_printed_is_refused() -> None:
    # README's example swaps blocks 0-7 without allocating them: with the owned pool (the
    # default) that is exactly the hole of issue 11, so it must raise (README to be updated)
    gpu_kv = [torch.randn(64, 16, 576, generator=torch.Generator().manual_seed(3))]
    keys = [hashlib.blake2b(bytes([i])).digest() for i in range(8)]
    async with OffloadManager(gpu_kv, ManagerConfig(num_cpu_blocks=128, policy="lru")) as mgr:
        with pytest.raises(InvalidBlockError):
            mgr.swap_out([0, 1, 2, 3, 4, 5, 6, 7], keys=keys)


@pytest.mark.asyncio
async def test_readme_round_trip_written_correctly_passes_check_invariants_at_every_step() -> None:
    gen = torch.Generator().manual_seed(4)
    gpu_kv = [torch.randn(64, 16, 576, generator=gen) for _ in range(4)]
    keys = [hashlib.blake2b(bytes([i])).digest() for i in range(8)]
    async with OffloadManager(gpu_kv, ManagerConfig(num_cpu_blocks=128, policy="lru")) as mgr:
        check_invariants(mgr)
        src = mgr.allocate("prompt", 8)  # the blocks the prompt was computed into
        check_invariants(mgr)
        stored = mgr.swap_out(src, keys=keys)
        check_invariants(mgr)
        await mgr.step()
        check_invariants(mgr)
        await stored
        check_invariants(mgr)
        hits = mgr.lookup(keys)
        assert hits == 8
        dst = mgr.allocate("next", hits)
        assert set(dst).isdisjoint(src)
        for t in gpu_kv:
            t[dst] = -7.0  # poison the destinations
        loaded = mgr.swap_in(keys[:hits], dst)
        check_invariants(mgr)
        await mgr.step()
        check_invariants(mgr)
        await loaded
        check_invariants(mgr)
        assert all(torch.equal(t[src], t[dst]) for t in gpu_kv)  # the bytes came back
        mgr.free("prompt")
        mgr.free("next")
        check_invariants(mgr)
        assert mgr.statistics().gpu_blocks_free == 64


# ====================================================================== 2. resize_


def _resize_grow(kv: list[torch.Tensor]) -> None:
    kv[0].resize_(4 * NUM_GPU, 584)  # storage reallocated: the manager's pointers are stale


def _resize_shrink(kv: list[torch.Tensor]) -> None:
    kv[0].resize_(NUM_GPU // 2, 584)  # fewer blocks than the manager manages


def _set_storage(kv: list[torch.Tensor]) -> None:
    # same shape, new memory (torch's stubs lack the one-tensor overload of set_)
    kv[1].set_(torch.randn(NUM_GPU, 2, 288).to(torch.bfloat16))  # type: ignore[call-overload]


def _reshape_in_place(kv: list[torch.Tensor]) -> None:
    # same pointer, same bytes, another shape: only the shape tells (and only the last tensor)
    kv[1].resize_(2 * NUM_GPU, 288)


def _restride_in_place(kv: list[torch.Tensor]) -> None:
    # same pointer, same shape, the page's two halves interleaved: only the strides tell
    kv[1].as_strided_((NUM_GPU, 2, 288), (576, 1, 2))


def _retype_in_place(kv: list[torch.Tensor]) -> None:
    # same pointer, shape and strides, other element type over the same storage (found by a
    # fresh-user pass): only the dtype tells
    t = kv[1]
    t.data = torch.tensor([], dtype=torch.float16).set_(t.untyped_storage(), 0, t.shape, t.stride())


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "move",
    [
        pytest.param(_resize_grow, id="resize-grow"),
        pytest.param(_resize_shrink, id="resize-shrink"),
        pytest.param(_set_storage, id="set"),
        pytest.param(_reshape_in_place, id="reshape-in-place"),
        pytest.param(_restride_in_place, id="restride-in-place"),
        pytest.param(_retype_in_place, id="retype-in-place"),
    ],
)
async def test_a_moved_kv_tensor_fails_the_batch_and_nothing_is_served(
    move: Callable[[list[torch.Tensor]], None],
) -> None:
    kv = _kv(seed=5)
    async with _serving(kv, _cfg()) as mgr:
        st = mgr.swap_out([0], [K[0]])  # before the move: a READY key to load later
        await mgr.step()
        await st
        cpu_before = mgr.cpu_pool.region.clone()
        move(kv)
        dst_before = [t[2].clone() for t in kv]
        store = mgr.swap_out([1], [K[1]])
        many = mgr.store_many(np.array([3, 4]), K[2:4])
        load = mgr.swap_in([K[0]], [2])
        await mgr.step()  # the step itself does not raise: the batches fail
        for future in (store, many, load):
            with pytest.raises(StaleKVTensorError, match="resize_"):
                await future
        # nothing is served: the stored keys are gone, no CPU or GPU byte was written
        assert mgr.lookup(K[:4]) == 1 and mgr.lookup(K[1:4]) == 0
        assert sorted(mgr.snapshot().keys) == [K[0]]
        assert mgr.snapshot().keys[K[0]].readers == 0
        assert torch.equal(mgr.cpu_pool.region, cpu_before)
        assert all(torch.equal(t[2], b) for t, b in zip(kv, dst_before))
        stats = mgr.statistics()
        assert (stats.stores_failed, stats.loads_failed, stats.cpu_blocks_used) == (3, 1, 1)
        assert (stats.stores_completed, stats.loads_completed) == (1, 0)
        check_invariants(mgr)
        # and it stays so: every later flush fails too
        again = mgr.swap_in([K[0]], [5])
        await mgr.step()
        with pytest.raises(StaleKVTensorError):
            await again
        check_invariants(mgr)


def test_stale_kv_tensor_error_is_a_transfer_error() -> None:
    assert issubclass(StaleKVTensorError, TransferError)


# ====================================================================== 3. batched API


@pytest.mark.asyncio
async def test_store_many_and_load_many_results_are_arrays_with_one_future_each() -> None:
    kv = _kv(seed=6)
    async with _serving(kv, _cfg(num_cpu_blocks=12)) as mgr:
        first = mgr.swap_out([0], [K[0]])  # K0 READY in CPU block 0
        await mgr.step()
        await first
        # 1. one call for three "requests": K0 (present), K1..K3 new; ids as a numpy array
        many = mgr.store_many(np.array([9, 1, 2, 3]), [K[0], K[1], K[2], K[3]])
        assert isinstance(many, asyncio.Future) and not many.done()
        assert mgr.snapshot().keys[K[2]].state is CpuState.PENDING
        # 2. per-call swaps in the same step
        one = mgr.swap_out([4], [K[4]])
        _poison(kv, 10)
        back = mgr.swap_in([K[0]], [10])
        check_invariants(mgr)
        report = await mgr.step()
        assert (report.d2h.swaps, report.d2h.blocks, report.d2h.batches) == (2, 4, 1)
        assert (report.h2d.swaps, report.h2d.blocks, report.h2d.batches) == (1, 1, 1)
        result = await many
        assert isinstance(result, StoreResult)
        assert result.stored.dtype == bool and result.cpu_block_ids.dtype == np.int64
        assert result.stored.tolist() == [False, True, True, True]
        assert result.present.tolist() == [True, False, False, False]
        assert result.cpu_block_ids.tolist() == [-1, 1, 2, 3]
        assert (result.num_stored, result.num_skipped) == (3, 1)
        assert result.num_bytes == 3 * BLOCK_BYTES
        assert await one == SwapResult(1, BLOCK_BYTES, 0, (4,), (4,))
        assert (await back).gpu_block_ids == (10,)
        assert [_cpu(mgr, c) for c in (1, 2, 3)] == [_gpu(kv, b) for b in (1, 2, 3)]
        assert _gpu(kv, 10) == _gpu(kv, 0)
        check_invariants(mgr)
        # 3. load_many: repeats allowed, ids as a list; every reader pinned until the copy ends
        dst = [13, 14, 15]
        for b in dst:
            _poison(kv, b)
        loads = mgr.load_many([K[1], K[3], K[1]], dst)
        assert mgr.snapshot().keys[K[1]].readers == 2
        assert mgr.statistics().cpu_keys_loading == 2
        check_invariants(mgr)
        await mgr.step()
        loaded = await loads
        assert isinstance(loaded, LoadResult)
        assert loaded.gpu_block_ids.tolist() == dst
        assert loaded.cpu_block_ids.tolist() == [1, 3, 1]
        assert (loaded.num_blocks, loaded.num_bytes) == (3, 3 * BLOCK_BYTES)
        assert [_gpu(kv, b) for b in dst] == [_gpu(kv, 1), _gpu(kv, 3), _gpu(kv, 1)]
        assert mgr.snapshot().keys[K[1]].readers == 0
        stats = mgr.statistics()
        assert (stats.stores_completed, stats.stores_skipped, stats.loads_completed) == (5, 1, 4)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_store_many_of_many_blocks_as_a_list_and_of_nothing() -> None:
    kv = _kv(seed=7)
    async with _serving(kv, _cfg(num_cpu_blocks=12)) as mgr:
        # more than a handful of ids as a plain list (the array path)
        ids = [15, 3, 8, 0, 1, 2, 11, 12, 5, 7]
        many = mgr.store_many(ids, K[:10])
        await mgr.step()
        result = await many
        assert result.stored.all() and not result.present.any()
        assert result.cpu_block_ids.tolist() == list(range(10))
        assert [_cpu(mgr, c) for c in range(10)] == [_gpu(kv, b) for b in ids]
        # nothing new to copy: the future is resolved at once, no batch
        again = mgr.store_many(np.array([4, 6]), K[:2])
        assert again.done()
        assert again.result().present.tolist() == [True, True]
        empty = mgr.store_many(np.array([], dtype=np.int64), [])
        assert empty.done() and empty.result().num_stored == 0
        assert mgr.statistics().queued_swaps == 0
        check_invariants(mgr)


async def _evicted_after_touching_the_last(parents: list[bytes | None] | None) -> list[bytes]:
    """Store A, B, C, D in one store_many (with ``parents``), touch D, then make one room:
    which key was evicted?"""
    kv = _kv(seed=8)
    async with _serving(kv, _cfg(num_cpu_blocks=4)) as mgr:
        many = mgr.store_many(np.arange(4), K[:4], parents=parents)
        await mgr.step()
        await many
        mgr.touch([K[3]])  # D becomes the most recently used
        await _swapped_out(mgr, [5], [K[9]])
        check_invariants(mgr)
        return sorted(set(K[:4]) - set(mgr.snapshot().keys))


@pytest.mark.asyncio
async def test_store_many_passes_parents_to_the_policy() -> None:
    # one chain (the default): D is the only leaf, so it goes first even though it is the
    # most recently used (prefix-consistent eviction)
    assert await _evicted_after_touching_the_last(None) == [K[3]]
    # four roots: plain LRU; after the insert the order is D C B A, then touch(D): C B A D
    assert await _evicted_after_touching_the_last([None] * 4) == [K[2]]


@pytest.mark.asyncio
async def test_a_chain_stored_by_swap_out_loses_its_leaf_first() -> None:
    # policy protocol v2: a store of [A, B, C, D] (one chain by default) must not leave A,
    # the prefix every lookup needs, as the first victim
    async with _serving(_kv(seed=30), _cfg(num_cpu_blocks=4)) as mgr:
        await _swapped_out(mgr, [0, 1, 2, 3], K[:4])
        mgr.take_events()
        for n, key in enumerate((K[10], K[11]), start=1):
            await _swapped_out(mgr, [4 + n], [key])
            assert (
                mgr.peek(K[:4]) == 4 - n
            )  # the ready prefix shrinks from its end (peek: no touch)
        assert [e.keys for e in mgr.take_events() if e.kind == "removed"] == [(K[3],), (K[2],)]
        check_invariants(mgr)


# ====================================================================== 4. peek, touch, invalidate, clear


@pytest.mark.asyncio
async def test_peek_touches_nothing_lookup_and_touch_do() -> None:
    kv = _kv(seed=9)
    async with _serving(kv, _cfg(num_cpu_blocks=3)) as mgr:
        await _roots(mgr, K[:3])
        order = mgr.policy.ordered_keys()
        assert order == K[:3]
        # 1. peek: the ready-prefix length, no policy change, counted apart from lookups
        assert mgr.peek([K[0], K[1], K[7]]) == 2
        assert mgr.peek([K[7], K[0]]) == 0
        assert mgr.policy.ordered_keys() == order
        stats = mgr.statistics()
        assert (stats.peeks, stats.lookups, stats.lookup_keys) == (2, 0, 0)
        # 2. touch: K0 becomes the most recent; unknown keys are ignored
        mgr.touch([K[0], K[7]])
        assert mgr.policy.ordered_keys() == [K[1], K[2], K[0]]
        assert mgr.statistics().lookups == 0
        # 3. a store now evicts K1 (peek did not save K0; touch did)
        st = mgr.swap_out([3], [K[3]])
        assert sorted(mgr.snapshot().keys) == sorted([K[0], K[2], K[3]])
        await mgr.step()
        await st
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_touch_ignores_pending_keys() -> None:
    kv = _kv(seed=10)
    async with _serving(kv, _cfg(num_cpu_blocks=3)) as mgr:
        await _roots(mgr, K[:3])
        mgr.invalidate([K[2]])
        st = mgr.swap_out([3], [K[3]])  # PENDING, the newest
        mgr.touch([K[0]])
        assert mgr.policy.ordered_keys() == [K[1], K[3], K[0]]
        mgr.touch([K[3], K[1]])  # K3 is PENDING: only K1 moves
        assert mgr.policy.ordered_keys() == [K[3], K[0], K[1]]
        await mgr.step()
        await st
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_invalidate_drops_ready_keys_and_refuses_keys_with_copies_in_flight() -> None:
    engine = NullEngine(hold=True)
    async with _serving(_kv(seed=11), _cfg(num_cpu_blocks=6), engine=engine) as mgr:
        await _roots(mgr, K[:3], engine)
        mgr.take_events()
        # 1. READY keys are dropped (unknown ones ignored, not counted), their blocks freed
        assert mgr.invalidate([K[1], K[9], K[1]]) == 1
        assert sorted(mgr.snapshot().keys) == sorted([K[0], K[2]])
        stats = mgr.statistics()
        assert (stats.invalidated, stats.cpu_blocks_used, stats.evictions) == (1, 2, 0)
        assert mgr.take_events() == [KVEvent("removed", (K[1],), "cpu")]
        check_invariants(mgr)
        # 2. a key with a queued store (PENDING) or a load in flight (readers) is refused, and
        #    nothing of the call is dropped, READY keys included
        pending = mgr.swap_out([5], [K[5]])
        loading = mgr.swap_in([K[0]], [6])
        await mgr.step()  # both held in flight by the engine
        before = mgr.snapshot()
        with pytest.raises(BlockStateError, match=K[5].hex()[:16]):
            mgr.invalidate([K[2], K[5]])
        with pytest.raises(BlockStateError, match=K[0].hex()[:16]):
            mgr.invalidate([K[2], K[0]])
        assert mgr.snapshot() == before
        assert mgr.statistics().invalidated == 1 and mgr.take_events() == []
        check_invariants(mgr)
        # 3. once the copies ended they can be invalidated
        engine.release()
        await asyncio.gather(pending, loading)
        assert mgr.invalidate([K[5], K[0]]) == 2
        assert sorted(mgr.snapshot().keys) == [K[2]]
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_clear_drops_every_idle_ready_key_and_keeps_those_in_flight() -> None:
    engine = NullEngine(hold=True)
    async with _serving(_kv(seed=12), _cfg(num_cpu_blocks=6), engine=engine) as mgr:
        await _roots(mgr, K[:4], engine)
        pending = mgr.swap_out([5], [K[5]])
        loading = mgr.swap_in([K[1]], [7])
        await mgr.step()
        mgr.take_events()
        # 1. K0, K2, K3 go; K1 (loading) and K5 (PENDING) stay
        assert mgr.clear() == 3
        assert sorted(mgr.snapshot().keys) == sorted([K[1], K[5]])
        (event,) = mgr.take_events()
        assert event.kind == "removed" and sorted(event.keys) == sorted([K[0], K[2], K[3]])
        assert mgr.statistics().invalidated == 3
        check_invariants(mgr)
        # 2. after the copies, a later clear drops them too; an empty tier clears nothing
        engine.release()
        await asyncio.gather(pending, loading)
        assert mgr.clear() == 2
        assert mgr.snapshot().keys == {} and mgr.statistics().cpu_blocks_used == 0
        assert mgr.clear() == 0
        check_invariants(mgr)


# ====================================================================== 5. KV events


@pytest.mark.asyncio
async def test_events_are_in_order_a_removal_before_the_store_that_evicted() -> None:
    kv = _kv(seed=13)
    async with _serving(kv, _cfg(num_cpu_blocks=2)) as mgr:
        for b in (0, 1):  # K0 then K1, one step each
            await _swapped_out(mgr, [b], [K[b]])
        assert mgr.take_events() == [
            KVEvent("stored", (K[0],), "cpu"),
            KVEvent("stored", (K[1],), "cpu"),
        ]
        assert mgr.take_events() == []  # drained
        # a store of K2, K3 evicts both K0 and K1: the removal comes first
        await _swapped_out(mgr, [2, 3], K[2:4])
        events = mgr.take_events()
        assert [e.kind for e in events] == ["removed", "stored"]
        assert sorted(events[0].keys) == sorted(K[:2])
        assert events[1].keys == (K[2], K[3])  # in the call's order


@pytest.mark.asyncio
async def test_a_failed_store_emits_no_event() -> None:
    kv = _kv(seed=15)
    engine = NullEngine(hold=True)
    async with _serving(kv, _cfg(num_cpu_blocks=2), engine=engine) as mgr:
        st = mgr.swap_out([0], [K[0]])
        await mgr.step()
        engine.complete_next(fail=True)
        with pytest.raises(TransferError):
            await st
        assert mgr.take_events() == []
        assert mgr.statistics().stores_failed == 1
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_the_async_iterator_yields_events_as_they_happen() -> None:
    kv = _kv(seed=16)
    async with _serving(kv, _cfg(num_cpu_blocks=2)) as mgr:
        seen: list[KVEvent] = []

        async def consume(n: int) -> None:
            async for event in mgr.events():
                seen.append(event)
                if len(seen) == n:
                    return

        consumer = asyncio.ensure_future(consume(4))
        await asyncio.sleep(0)  # the consumer waits for the first event
        for b in range(3):  # the third store evicts K0
            await _swapped_out(mgr, [b], [K[b]])
        await asyncio.wait_for(consumer, timeout=10)
        assert seen == [
            KVEvent("stored", (K[0],)),
            KVEvent("stored", (K[1],)),
            KVEvent("removed", (K[0],)),
            KVEvent("stored", (K[2],)),
        ]
        assert mgr.take_events() == []  # the iterator drained the same stream
        # a cancelled consumer leaves the stream usable
        waiting = asyncio.ensure_future(consume(99))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert mgr.invalidate([K[1]]) == 1
        assert mgr.take_events() == [KVEvent("removed", (K[1],))]


@pytest.mark.asyncio
async def test_a_bounded_stream_drops_the_oldest_and_counts_them() -> None:
    kv = _kv(seed=17)
    async with _serving(kv, _cfg(num_cpu_blocks=8, max_events=2)) as mgr:
        for b in range(5):
            await _swapped_out(mgr, [b], [K[b]])
        assert mgr.take_events() == [KVEvent("stored", (K[3],)), KVEvent("stored", (K[4],))]
        assert mgr.statistics().events_dropped == 3
    async with _serving(_kv(seed=18), _cfg(num_cpu_blocks=8, max_events=0)) as mgr:
        await _swapped_out(mgr, [0], [K[0]])
        assert mgr.invalidate([K[0]]) == 1
        assert mgr.take_events() == []  # recording disabled: nothing kept, nothing dropped
        assert mgr.statistics().events_dropped == 0


# ====================================================================== 6. store_threshold


@pytest.mark.asyncio
async def test_store_threshold_stores_a_key_only_once_seen_n_times() -> None:
    kv = _kv(seed=19)
    async with _serving(kv, _cfg(store_threshold=3)) as mgr:
        # sightings 1 and 2: not admitted, nothing copied, resolved at once
        for n in (1, 2):
            st = mgr.swap_out([0, 1], K[:2])
            assert st.done() and st.result() == SwapResult(0, 0, 2)
            assert mgr.statistics().stores_not_admitted == 2 * n
        assert mgr.snapshot().keys == {} and mgr.lookup(K[:2]) == 0
        # a key seen once alongside: K2's first sighting
        many = mgr.store_many(np.array([2, 3]), [K[0], K[2]])
        await mgr.step()
        result = await many
        # third sighting of K0: stored; K2 is seen for the first time only
        assert result.stored.tolist() == [True, False]
        assert result.present.tolist() == [False, False]  # not admitted is not "present"
        assert result.cpu_block_ids.tolist()[1] == -1
        assert mgr.lookup([K[0]]) == 1 and mgr.peek([K[2]]) == 0
        stats = mgr.statistics()
        assert (stats.stores_not_admitted, stats.stores_completed, stats.stores_skipped) == (
            5,
            1,
            0,
        )
        # once stored, a key is "present", not "not admitted"
        again = mgr.swap_out([4], [K[0]])
        assert again.result() == SwapResult(0, 0, 1)
        assert mgr.statistics().stores_skipped == 1
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_store_threshold_one_stores_on_first_sight() -> None:
    kv = _kv(seed=20)
    async with _serving(kv, _cfg()) as mgr:
        st = mgr.swap_out([0], [K[0]])
        await mgr.step()
        assert (await st).num_blocks == 1
        assert mgr.statistics().stores_not_admitted == 0


# ====================================================================== 7. typed errors


def test_a_swap_outside_a_running_loop_raises_event_loop_error() -> None:
    kv = _kv(seed=21)
    mgr = OffloadManager(kv, _cfg())
    try:
        mgr.allocate("r", 2)  # bookkeeping only: fine without a loop
        before = mgr.snapshot()
        calls: list[Callable[[], Any]] = [
            lambda: mgr.swap_out([0], [K[0]]),
            lambda: mgr.store_many(np.array([0]), [K[0]]),
            lambda: mgr.swap_in([K[0]], [1]),
            lambda: mgr.load_many([K[0]], np.array([1])),
            lambda: mgr.preempt("r"),
        ]
        for call in calls:
            with pytest.raises(EventLoopError, match="event loop") as info:
                call()
            assert isinstance(info.value, KVMgrError)
        assert mgr.snapshot() == before
    finally:
        mgr.close()


def test_a_swap_on_another_loop_while_work_is_queued_raises_event_loop_error() -> None:
    mgr = OffloadManager(_kv(seed=28), _cfg())

    async def first() -> asyncio.Future[SwapResult]:
        mgr.allocate("r", 2)
        return mgr.swap_out([0], [K[0]])  # queued on this loop, never stepped

    async def second() -> None:
        before = mgr.snapshot()
        with pytest.raises(EventLoopError, match="another event loop"):
            mgr.swap_out([1], [K[1]])
        assert mgr.snapshot() == before

    try:
        queued = asyncio.run(first())
        asyncio.run(second())
    finally:
        mgr.close()
    assert isinstance(queued.exception(), ClosedError)


@pytest.mark.asyncio
async def test_wait_rejects_what_is_not_a_future_or_a_timeout() -> None:
    async with OffloadManager(_kv(seed=22), _cfg()) as mgr:
        with pytest.raises(InvalidArgumentError, match="'x'"):
            await mgr.wait("x", 1)  # type: ignore[arg-type]
        future = asyncio.get_running_loop().create_future()
        for bad in (-1, "1", float("nan"), float("inf"), True):
            with pytest.raises(InvalidArgumentError, match="timeout_s"):
                await mgr.wait(future, bad)  # type: ignore[arg-type]
        future.cancel()


def test_a_cpu_tier_too_large_to_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=str(10**21)):
        ManagerConfig(num_cpu_blocks=10**21)


def test_an_impossible_host_allocation_raises_host_memory_error() -> None:
    # 2**21 CPU blocks of one 128 MiB page: 2**48 bytes, beyond any address space. The KV
    # tensor is never read, so it need not be filled.
    kv = [torch.empty(1, 1 << 27, dtype=torch.uint8)]
    cfg = ManagerConfig(num_cpu_blocks=1 << 21, engine="host")
    with pytest.raises(HostMemoryError, match="num_cpu_blocks") as info:
        OffloadManager(kv, cfg)
    assert info.value.num_bytes == 1 << 48
    assert isinstance(info.value, MemoryError) and isinstance(info.value, KVMgrError)
    assert not isinstance(info.value, TransferError)


@pytest.mark.asyncio
async def test_transfer_timeout_error_is_not_the_builtin_timeout_error() -> None:
    assert not issubclass(TransferTimeoutError, TimeoutError)
    assert issubclass(ClosedBeforeCopyError, ClosedError)
    assert issubclass(ClosedBeforeCopyError, TransferError)
    engine = NullEngine(hold=True)
    async with _serving(_kv(seed=23), _cfg(), engine=engine) as mgr:
        st = mgr.swap_out([0], [K[0]])
        await mgr.step()
        # kvmgr's deadline: TransferTimeoutError, which `except TimeoutError` does not catch
        with pytest.raises(TransferTimeoutError) as info:
            try:
                await mgr.wait(st, 0.001)
            except TimeoutError:  # pragma: no cover - the failure this test guards against
                pytest.fail("TransferTimeoutError was caught as a builtin TimeoutError")
        assert not isinstance(info.value, TimeoutError)
        # asyncio's own deadline around a kvmgr await: the builtin, not a kvmgr error
        with pytest.raises(TimeoutError) as outer:
            await asyncio.wait_for(asyncio.shield(st), 0.001)
        assert not isinstance(outer.value, KVMgrError)
        assert mgr.statistics().await_timeouts == 1 and not st.done()
        engine.release()
        assert (await st).num_blocks == 1


def _buggy_engine() -> ScriptedEngine:
    """A host engine whose submit has a bug (not a kvmgr error)."""

    def bug(_batch_id: int, _plan: TransferPlan) -> None:
        raise ZeroDivisionError("engine bug")

    return ScriptedEngine(HostEngine(), on_submit=bug)


@pytest.mark.asyncio
async def test_an_engine_bug_is_not_relabelled_transfer_error() -> None:
    kv = _kv(seed=24)
    async with _serving(kv, _cfg(), engine=_buggy_engine()) as mgr:
        st = mgr.swap_out([0], [K[0]])
        with pytest.raises(ZeroDivisionError):
            await mgr.step()  # re-raised after every lane was handled
        with pytest.raises(ZeroDivisionError):
            await st  # the swap fails with the bug itself
        assert mgr.snapshot().keys == {}  # rolled back
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_statistics_histograms_count_every_batch() -> None:
    async with _serving(_kv(seed=29), _cfg()) as mgr:
        stats = mgr.statistics()
        assert stats.batch_blocks is not None and stats.batch_blocks.num == 0
        st = mgr.store_many(np.arange(5), K[:5])  # one batch of 5 blocks
        await mgr.step()
        await st
        ld = mgr.swap_in([K[0]], [9])  # one batch of 1 block
        await mgr.step()
        await ld
        stats = mgr.statistics()
        blocks, latency = stats.batch_blocks, stats.completion_s
        assert blocks is not None and latency is not None
        assert (blocks.num, blocks.total) == (2, 6.0)
        assert len(blocks.counts) == len(blocks.bounds) + 1
        assert blocks.counts[0] == 1 and blocks.counts[2] == 1  # <= 1 and in (4, 16]
        assert latency.num == 2 and latency.total > 0


# ====================================================================== 8. NullEngine


@pytest.mark.asyncio
async def test_null_engine_completes_at_once_and_copies_nothing() -> None:
    kv = _kv(seed=25)
    engine = NullEngine()
    async with _serving(kv, _cfg(), engine=engine) as mgr:
        st = mgr.swap_out([0, 1], K[:2])
        await mgr.step()
        await _settle()
        assert st.done() and (await st).cpu_block_ids == (0, 1)
        assert mgr.lookup(K[:2]) == 2
        dst = _poison(kv, 5)
        ld = mgr.swap_in([K[0]], [5])
        await mgr.step()
        assert (await ld).gpu_block_ids == (5,)
        assert _gpu(kv, 5) == dst  # nothing was copied
        stats = engine.statistics()
        assert (stats.batches_submitted, stats.batches_completed, stats.in_flight) == (2, 2, 0)
        assert (stats.bytes_d2h, stats.bytes_h2d) == (2 * BLOCK_BYTES, BLOCK_BYTES)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_null_engine_holds_batches_until_told() -> None:
    kv = _kv(seed=26)
    engine = NullEngine(hold=True)
    async with _serving(kv, _cfg(), engine=engine) as mgr:
        first = mgr.swap_out([0], [K[0]])
        await mgr.step()
        await _settle()
        assert not first.done() and engine.num_pending == 1
        assert mgr.snapshot().keys[K[0]].state is CpuState.PENDING
        check_invariants(mgr)
        # 1. complete_next resolves the oldest batch
        assert len(engine.complete_next()) == 1
        await first
        assert mgr.lookup([K[0]]) == 1
        # 2. a store and a load in one step: two batches, the first failed on purpose
        store = mgr.swap_out([1], [K[1]])
        load = mgr.swap_in([K[0]], [2])
        await mgr.step()
        assert engine.num_pending == 2
        assert len(engine.complete_next(1, fail=True)) == 1
        with pytest.raises(TransferError, match="injected fault"):
            await store
        assert not load.done()
        check_invariants(mgr)
        # 3. release resolves the rest and stops holding
        assert len(engine.release()) == 1
        await load
        later = mgr.swap_out([3], [K[3]])
        await mgr.step()
        await _settle()
        assert later.done() and engine.num_pending == 0
        assert engine.complete_next() == []  # nothing left
        stats = engine.statistics()
        assert (stats.batches_submitted, stats.batches_completed, stats.batches_failed) == (4, 3, 1)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_null_engine_close_resolves_what_it_holds() -> None:
    kv = _kv(seed=27)
    engine = NullEngine(hold=True)
    mgr = OffloadManager(kv, _cfg(), engine=engine)
    await mgr.__aenter__()
    _hold(mgr)
    st = mgr.swap_out([0], [K[0]])
    await mgr.step()
    assert engine.num_pending == 1
    await mgr.aclose(timeout_s=0.01)  # the held batch never ends by itself: close releases it
    assert engine.num_pending == 0 and mgr.closed
    assert (await st).num_blocks == 1
    assert mgr.snapshot().keys[K[0]].state is CpuState.READY
    check_invariants(mgr)


def _refuses_huge_allocations() -> bool:
    """Whether this kernel refuses (rather than lazily grants) a 1 TiB allocation."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            mode = f.read().strip()
        with open("/proc/meminfo") as f:
            kib = sum(
                int(line.split()[1]) for line in f if line.startswith(("MemTotal", "SwapTotal"))
            )
    except OSError:
        return False
    return mode in ("0", "2") and kib * 1024 < 1 << 39


@pytest.mark.skipif(not _refuses_huge_allocations(), reason="the kernel may overcommit 1 TiB")
def test_a_cpu_tier_whose_bookkeeping_cannot_be_allocated_raises_host_memory_error() -> None:
    # 2**40 blocks (the most ManagerConfig accepts): the CPU tier's per-block arrays alone
    # cannot be allocated; a typed error, not a bare MemoryError from numpy or bytearray
    cfg = ManagerConfig(num_cpu_blocks=1 << 40, engine="host")
    with pytest.raises(HostMemoryError, match=str(1 << 40)):
        OffloadManager([torch.randn(4, 64)], cfg)


@pytest.mark.asyncio
async def test_the_event_iterator_ends_when_the_manager_closes() -> None:
    # found by a fresh-user pass: an `async for` over mgr.events() used to wait forever after
    # aclose(); it now yields what was recorded (the close's `cleared` last), then stops
    kv = [torch.randn(8, 4, generator=torch.Generator().manual_seed(7))]
    mgr = OffloadManager(kv, ManagerConfig(num_cpu_blocks=4))
    got = []

    async def consume() -> None:
        async for event in mgr.events():
            got.append(event)

    async with mgr:
        task = asyncio.create_task(consume())
        await _swapped_out(mgr, mgr.allocate("a", 2), [b"a", b"b"])
    await asyncio.wait_for(task, 5)
    assert [(e.kind, e.keys) for e in got] == [("stored", (b"a", b"b")), ("cleared", ())]


@pytest.mark.asyncio
async def test_a_key_cannot_be_its_own_parent() -> None:
    kv = [torch.randn(8, 4, generator=torch.Generator().manual_seed(8))]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=4)) as mgr:
        ids = mgr.allocate("a", 1)
        with pytest.raises(kvmgr.errors.InvalidKeyError, match="own parent"):
            mgr.store_many(ids, [b"k"], parents=[b"k"])
        assert mgr.statistics().stores_queued == 0
