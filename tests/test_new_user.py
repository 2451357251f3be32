"""Issue 20: what a new user hit, one regression test per finding (stuck states, false alarms).

1. Key cycles (a parent chain reaching the key itself, in one call or across calls, or
   through a re-stored invalidated parent) are refused with ``InvalidKeyError`` before
   anything changes; ``check_invariants`` names a cycle in a snapshot.
2. ``check_invariants`` accepts a load fenced on the newer of two stores of its block (the
   stores of one direction run in order), and still flags a load fenced on neither.
3. With ``backpressure="wait"``, the step that lets a waiting store find room (the next piece
   of a tier pinned in the background) also submits it.
4. Arguments of the wrong type (config fields, step contexts, engines, namespaces, tiers,
   nested tensors) raise kvmgr's typed errors, before anything is built.
5. ``PoolExhaustedError`` says what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvmgr import (
    ConfigError,
    GeometryError,
    InvalidArgumentError,
    InvalidKeyError,
    ManagerConfig,
    OffloadManager,
    PoolExhaustedError,
    TransferError,
)
from kvmgr.hooks import StepContext
from kvmgr.testing import FaultyEngine, check_invariants
from kvmgr.testing.invariants import InvariantError
from kvmgr.transfer import HostEngine

K = [f"user-{i}".encode() for i in range(16)]


def _kv(num_blocks: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, 7, generator=gen), torch.randn(num_blocks, 9, generator=gen)]


@contextlib.asynccontextmanager
async def _manager(
    num_cpu_blocks: int = 6, *, refuse: tuple[int, ...] = (), **config: object
) -> AsyncIterator[tuple[OffloadManager, FaultyEngine]]:
    engine = FaultyEngine(HostEngine(), refuse_batches=refuse)
    cfg = ManagerConfig(num_cpu_blocks=num_cpu_blocks, **config)  # type: ignore[arg-type]
    mgr = OffloadManager(_kv(), cfg, engine=engine)
    await mgr.__aenter__()
    try:
        yield mgr, engine
    finally:
        engine.release()
        await mgr.aclose(timeout_s=2.0)


# ====================================================================== 1. key cycles


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.asyncio
async def test_a_key_cycle_within_one_call_is_refused(batched: bool) -> None:
    async with _manager() as (mgr, _engine):
        gpu = mgr.allocate("r", 3)
        before = mgr.snapshot()
        for keys, parents in (
            ([K[0], K[1]], [K[1], K[0]]),
            ([K[0], K[1], K[2]], [K[2], K[0], K[1]]),
            ([K[0], K[1], K[2]], [None, K[2], K[1]]),
        ):
            with pytest.raises(InvalidKeyError, match="cycle"):
                if batched:
                    mgr.store_many(gpu[: len(keys)], keys, parents=parents)
                else:
                    mgr.swap_out(gpu[: len(keys)], keys, parents)
            assert mgr.snapshot() == before


@pytest.mark.asyncio
async def test_a_key_cycle_across_calls_is_refused_and_the_tier_stays_usable() -> None:
    async with _manager(num_cpu_blocks=3) as (mgr, _engine):
        gpu = mgr.allocate("r", 6)
        first = mgr.store_many(gpu[:1], [K[2]], parents=[K[3]])  # C extends D (not stored)
        await mgr.step()
        await first
        before = mgr.snapshot()
        with pytest.raises(InvalidKeyError, match="cycle"):
            mgr.store_many(gpu[1:2], [K[3]], parents=[K[2]])  # D extends C: C -> D -> C
        with pytest.raises(InvalidKeyError, match="cycle"):
            mgr.swap_out(gpu[1:3], [K[4], K[3]], [K[2], K[4]])  # D -> E -> C -> D
        assert mgr.snapshot() == before
        # D as a root is fine; after it the tier still evicts (it used to fill up for good)
        ok = mgr.store_many(gpu[1:2], [K[3]], parents=[None])
        await mgr.step()
        await ok
        more = mgr.store_many(gpu[2:5], K[5:8])
        await mgr.step()
        assert (await more).stored.all()
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_an_invalidated_root_stored_again_below_its_child_is_refused() -> None:
    async with _manager() as (mgr, _engine):
        gpu = mgr.allocate("r", 3)
        chain = mgr.swap_out(gpu[:2], K[:2])  # K1 extends K0
        await mgr.step()
        await chain
        assert mgr.invalidate([K[0]]) == 1  # K1 stays, its parent is gone
        with pytest.raises(InvalidKeyError, match="cycle"):
            mgr.swap_out([gpu[2]], [K[0]], [K[1]])  # K0 would extend its own child
        again = mgr.swap_out([gpu[2]], [K[0]])  # as a root: fine (also on the per-call path)
        await mgr.step()
        await again
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_waiting_store_that_would_close_a_cycle_fails_typed() -> None:
    async with _manager(num_cpu_blocks=2, backpressure="wait", store_wait_s=30.0) as (mgr, eng):
        gpu = mgr.allocate("r", 5)
        fill = mgr.store_many(gpu[:2], K[:2], parents=[None, None])
        await mgr.step()
        await fill
        eng.hold()
        load = mgr.swap_in(K[:2], gpu[2:4])  # pins both: the next store waits
        await mgr.step()
        waiting = mgr.store_many([gpu[4]], [K[8]], parents=[K[9]])
        cyc = mgr.store_many([gpu[4]], [K[9]], parents=[K[8]])  # K8 not indexed yet: waits too
        assert mgr.statistics().stores_waiting == 2
        eng.release()
        await load
        await mgr.step()
        await asyncio.wait_for(waiting, 5.0)
        with pytest.raises(InvalidKeyError, match="cycle"):
            await asyncio.wait_for(cyc, 5.0)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_check_invariants_names_a_key_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    async with _manager() as (mgr, _engine):
        gpu = mgr.allocate("r", 2)
        st = mgr.store_many(gpu, K[:2])
        await mgr.step()
        await st
        check_invariants(mgr)
        snap = mgr.snapshot()
        assert snap.key_parents == {K[0]: None, K[1]: K[0]}
        bad = attrs.evolve(snap, key_parents={K[0]: K[1], K[1]: K[0]})
        monkeypatch.setattr(mgr, "snapshot", lambda: bad)
        with pytest.raises(InvariantError, match="key cycle"):
            check_invariants(mgr)


# ====================================================================== 2. fences


async def _ready_then_held(mgr: OffloadManager, engine: Any) -> list[int]:
    """Request "r" on 2 GPU blocks, K[0] stored from the first one and READY; then the engine
    holds every batch. Returns the request's GPU block ids."""
    gpu = mgr.allocate("r", 2)
    ready = mgr.swap_out([gpu[0]], [K[0]])
    await mgr.step()
    await ready
    engine.hold()
    return gpu


@pytest.mark.asyncio
async def test_a_load_fenced_on_the_newer_of_two_stores_is_no_false_alarm() -> None:
    async with _manager() as (mgr, engine):
        gpu = await _ready_then_held(mgr, engine)
        g = gpu[1]
        first = mgr.swap_out([g], [K[1]])
        await mgr.step()  # D2H batch 1
        second = mgr.swap_out([g], [K[2]], [None])
        await mgr.step()  # D2H batch 2, after batch 1 on the same lane
        load = mgr.swap_in([K[0]], [g])  # H2D batch 3: fenced on batch 2 only
        await mgr.step()
        waits = [b.engine_wait_for for b in mgr.snapshot().batches]
        assert waits[-1] and len(waits[-1]) == 1  # the newer store only: enough
        check_invariants(mgr)  # used to report "share GPU blocks without a wait_for fence"
        engine.release()
        await asyncio.gather(first, second, load)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_refused_store_leaves_the_load_fenced_on_the_store_before_it() -> None:
    # Found by the state machine: the refused batch was the block's last D2H batch, so it
    # left no mark and the load was submitted without a fence while batch 1 still read the block
    async with _manager(refuse=(2,)) as (mgr, engine):
        gpu = await _ready_then_held(mgr, engine)
        g = gpu[1]
        first = mgr.swap_out([g], [K[1]])
        await mgr.step()  # D2H batch 1, held
        second = mgr.swap_out([g], [K[2]], [None])
        await mgr.step()  # D2H batch 2: refused at submit
        with pytest.raises(TransferError, match="refused"):
            await second
        load = mgr.swap_in([K[0]], [g])
        await mgr.step()  # H2D batch 3 writes the block batch 1 still reads
        (held, loading) = mgr.snapshot().batches
        assert loading.engine_wait_for == (held.engine_batch_id,)
        check_invariants(mgr)
        engine.release()
        await asyncio.gather(first, load)
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_check_invariants_still_flags_an_unfenced_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _manager() as (mgr, engine):
        gpu = await _ready_then_held(mgr, engine)
        store = mgr.swap_out([gpu[1]], [K[1]])
        await mgr.step()
        load = mgr.swap_in([K[0]], [gpu[1]])
        await mgr.step()
        check_invariants(mgr)
        record = engine.unresolved_wait_for
        monkeypatch.setattr(
            engine, "unresolved_wait_for", lambda b: None if record(b) is None else ()
        )
        with pytest.raises(InvariantError, match="without a wait_for fence"):
            check_invariants(mgr)
        monkeypatch.undo()
        engine.release()
        await asyncio.gather(store, load)


# ====================================================================== 3. backpressure


@pytest.mark.asyncio
async def test_the_step_that_sees_the_next_pinned_piece_submits_the_waiting_store() -> None:
    from test_pinning import waiting_for_the_next_piece

    async with waiting_for_the_next_piece() as (mgr, waiting, ready):
        report = await mgr.step()  # sees the pieces, wakes the store AND submits it
        assert report.d2h.blocks == ready + 5  # it used to be queued after this step
        result = await asyncio.wait_for(waiting, 30)
        assert result.stored.all()
        check_invariants(mgr)


# ====================================================================== 4. typed errors


@pytest.mark.parametrize(
    "field",
    [
        {"manage_gpu_blocks": 1},
        {"merge": "yes"},
        {"tier_write_through": None},
        {"tier_write_back": 0},
        {"allow_pageable": "no"},
        {"policy_options": []},
        {"policy_options": {1: 2}},
        {"store_wait_s": float("inf")},
        {"store_wait_s": float("nan")},
    ],
)
def test_a_config_field_of_the_wrong_type_is_a_config_error(field: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        ManagerConfig(num_cpu_blocks=2, **field)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError) and next(iter(field)) in str(caught.value)


@pytest.mark.parametrize(
    "ctx", [{"step": "x"}, {"step": -1}, {"step": True}, {"is_capturing": 1}, {"tensors": []}]
)
def test_a_bad_step_context_is_an_invalid_argument(ctx: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        StepContext(**ctx)  # type: ignore[arg-type]
    StepContext(step=np.int64(3))  # numpy ints are ints


@pytest.mark.parametrize("what", ["engine", "tier_namespace", "tiers", "nested"])
def test_bad_manager_arguments_are_typed_and_allocate_nothing(
    what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[object] = []
    real = HostEngine.__init__
    monkeypatch.setattr(
        HostEngine, "__init__", lambda self, *a, **k: built.append(self) or real(self, *a, **k)
    )
    cfg = ManagerConfig(num_cpu_blocks=2, engine="host")
    kv: list[torch.Tensor] = _kv()
    kwargs: dict[str, object] = {}
    if what == "engine":
        kwargs["engine"] = object()
    elif what == "tier_namespace":
        kwargs["tier_namespace"] = object()
    elif what == "tiers":
        kwargs["tiers"] = [object()]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kv = [torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(3, 3)])]
    error = GeometryError if what == "nested" else ConfigError
    with pytest.raises(error):
        OffloadManager(kv, cfg, **kwargs)  # type: ignore[arg-type]
    assert built == []  # refused before any engine (and CPU tier) was built


# ====================================================================== 5. messages


@pytest.mark.asyncio
async def test_pool_exhausted_says_what_to_do() -> None:
    async with _manager(num_cpu_blocks=1) as (mgr, engine):
        gpu = mgr.allocate("r", 8)
        with pytest.raises(PoolExhaustedError) as caught:
            mgr.allocate("s", 1)
        assert "free()" in str(caught.value) and "preempt()" in str(caught.value)
        engine.hold()
        store = mgr.swap_out(gpu[:1], K[:1])
        await mgr.step()
        with pytest.raises(PoolExhaustedError) as caught:
            mgr.swap_out(gpu[1:2], K[1:2])
        message = str(caught.value)
        for hint in ("free()", "invalidate()", 'backpressure="wait"', "num_cpu_blocks"):
            assert hint in message
        engine.release()
        await store
