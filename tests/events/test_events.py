"""The router detail of the KV event stream (issue 28 part 3), on the host engine.

1. ``stored`` events carry each key's parent and, when the store gave them, its token ids: the
   rows of the keys actually stored (present keys skipped, repeats once), in one event per lane,
   or one per store when a lane mixes stores with and without tokens.
2. ``token_ids`` is validated (typed error, nothing changed) and copied.
3. Never advertise what the tier cannot serve (vllm #57159): no ``stored`` before the copy
   landed, none for a failed store, a removal before the store that evicted it (recorded
   before that store's copy is submitted), ``cleared`` last, at close.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
import torch

from kvmgr import InvalidArgumentError, ManagerConfig, OffloadManager, TransferError
from kvmgr.events.tokens import check_token_ids
from kvmgr.reports import KVEvent
from kvmgr.testing import NullEngine, check_invariants

K = [hashlib.blake2b(f"ev{i}".encode(), digest_size=16).digest() for i in range(32)]
BLOCK_SIZE = 4


def _kv(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (16, 96), dtype=torch.uint8, generator=gen) for _ in range(2)]


def _cfg(**kw: object) -> ManagerConfig:
    kw.setdefault("num_cpu_blocks", 8)
    return ManagerConfig(engine="host", manage_gpu_blocks=False, **kw)  # type: ignore[arg-type]


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 150_000, size=(n, BLOCK_SIZE))


# ====================================================================== 1. parents and tokens


@pytest.mark.asyncio
async def test_a_stored_event_carries_parents_and_the_token_rows_of_the_keys_stored() -> None:
    async with OffloadManager(_kv(1), _cfg()) as mgr:
        # 1. K0 K1 stored first (a chain: K1 extends K0)
        first = _tokens(2, 1)
        st = mgr.swap_out([0, 1], K[:2], token_ids=first)
        await mgr.step()
        await st
        (event,) = mgr.take_events()
        assert event == KVEvent("stored", tuple(K[:2]))
        assert event.parents == (None, K[0])
        assert event.token_ids is not None and event.token_ids.dtype == np.int32
        np.testing.assert_array_equal(event.token_ids, first)
        # 2. a store of K0..K3 with explicit parents: K0 K1 are present (skipped), so the event
        #    has K2 K3 with their own parents and rows 2 and 3 of the call's tokens
        tokens = _tokens(4, 2)
        parents = [None, K[0], K[1], K[2]]
        st = mgr.store_many(np.arange(2, 6), K[:4], parents=parents, token_ids=tokens.ravel())
        await mgr.step()
        result = await st
        assert result.stored.tolist() == [False, False, True, True]
        (event,) = mgr.take_events()
        assert event.keys == (K[2], K[3]) and event.parents == (K[1], K[2])
        np.testing.assert_array_equal(event.token_ids, tokens[2:])
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_repeated_key_keeps_the_row_of_its_first_occurrence() -> None:
    async with OffloadManager(_kv(2), _cfg()) as mgr:
        tokens = _tokens(3, 3)
        st = mgr.store_many([0, 1, 2], [K[0], K[1], K[0]], parents=[None, K[0], None],
                            token_ids=tokens)  # fmt: skip
        await mgr.step()
        await st
        (event,) = mgr.take_events()
        assert event.keys == (K[0], K[1]) and event.parents == (None, K[0])
        np.testing.assert_array_equal(event.token_ids, tokens[:2])


@pytest.mark.asyncio
async def test_one_event_per_lane_with_tokens_concatenated_and_per_store_when_mixed() -> None:
    async with OffloadManager(_kv(3), _cfg()) as mgr:
        # 1. two stores with tokens in one step: one event, rows in call order
        a, b = _tokens(1, 4), _tokens(2, 5)
        stores = [mgr.swap_out([0], [K[0]], token_ids=a), mgr.swap_out([1, 2], K[1:3], token_ids=b)]
        await mgr.step()
        for st in stores:
            await st
        (event,) = mgr.take_events()
        assert event.keys == (K[0], K[1], K[2]) and event.parents == (None, None, K[1])
        np.testing.assert_array_equal(event.token_ids, np.concatenate([a, b]))
        # 2. one store with tokens and one without in one step: one event per store, each exact
        c = _tokens(1, 6)
        stores = [mgr.swap_out([3], [K[3]]), mgr.swap_out([4], [K[4]], token_ids=c)]
        await mgr.step()
        for st in stores:
            await st
        plain, with_tokens = mgr.take_events()
        assert plain.keys == (K[3],) and plain.token_ids is None and plain.parents == (None,)
        assert with_tokens.keys == (K[4],)
        np.testing.assert_array_equal(with_tokens.token_ids, c)


# ====================================================================== 2. validation


@pytest.mark.parametrize(
    ("token_ids", "match"),
    [
        (np.zeros((2, 4), dtype=np.float32), "integer"),
        (np.zeros((3, 4), dtype=np.int64), "shape"),
        ([1, 2, 3], "shape"),
        (np.zeros((2, 0), dtype=np.int64), "shape"),
        (np.array([[1, -2], [3, 4]]), "token id -2"),
        (np.array([[1, 2], [3, 1 << 31]]), "outside"),
        ("abcd", "integer"),
        ([[True, False], [True, True]], "integer"),
    ],
)
@pytest.mark.asyncio
async def test_bad_token_ids_raise_a_typed_error_and_change_nothing(
    token_ids: object, match: str
) -> None:
    async with OffloadManager(_kv(4), _cfg()) as mgr:
        before = mgr.snapshot()
        with pytest.raises(InvalidArgumentError, match=match):
            mgr.swap_out([0, 1], K[:2], token_ids=token_ids)
        with pytest.raises(InvalidArgumentError, match=match):
            mgr.store_many([0, 1], K[:2], token_ids=token_ids)
        assert mgr.snapshot() == before
        assert mgr.take_events() == []


def test_token_ids_are_copied_from_numpy_torch_and_lists() -> None:
    source = np.arange(8, dtype=np.int64).reshape(2, 4)
    out = check_token_ids(source, 2)
    source[0, 0] = 99  # the caller reuses its buffer
    assert out[0, 0] == 0 and out.flags.c_contiguous and out.dtype == np.int32
    np.testing.assert_array_equal(check_token_ids(torch.arange(8), 2), np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(check_token_ids([[1, 2], [3, 4]], 2), [[1, 2], [3, 4]])


# ====================================================================== 3. never advertise too early


@pytest.mark.asyncio
async def test_no_stored_event_before_the_copy_landed_and_none_for_a_failed_store() -> None:
    engine = NullEngine(hold=True)
    async with OffloadManager(_kv(5), _cfg(num_cpu_blocks=2), engine=engine) as mgr:
        # 1. queued and submitted, not landed: nothing advertised yet
        st = mgr.swap_out([0], [K[0]], token_ids=_tokens(1, 7))
        await mgr.step()
        assert mgr.take_events() == []
        assert len(engine.complete_next()) == 1
        await st
        assert [e.kind for e in mgr.take_events()] == ["stored"]
        # 2. a failed store advertises nothing
        st = mgr.swap_out([1], [K[1]], token_ids=_tokens(1, 8))
        await mgr.step()
        engine.complete_next(fail=True)
        with pytest.raises(TransferError):
            await st
        assert mgr.take_events() == []
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_a_removal_is_recorded_before_the_evicting_copy_is_submitted() -> None:
    engine = NullEngine(hold=True)
    async with OffloadManager(_kv(6), _cfg(num_cpu_blocks=2), engine=engine) as mgr:
        st = mgr.swap_out([0, 1], K[:2])
        await mgr.step()
        engine.complete_next()
        await st
        mgr.take_events()
        # a store of K2 K3 evicts K0 and K1: the removal is in the stream at once, before the
        # copy that overwrites their blocks is even submitted, and the stored event after it lands
        st = mgr.swap_out([2, 3], K[2:4])
        (removed,) = mgr.take_events()
        assert removed.kind == "removed" and sorted(removed.keys) == sorted(K[:2])
        assert engine.statistics().batches_submitted == 1  # only the first store's batch yet
        await mgr.step()
        assert mgr.take_events() == []
        engine.complete_next()
        await st
        assert mgr.take_events() == [KVEvent("stored", (K[2], K[3]))]


@pytest.mark.asyncio
async def test_close_ends_the_stream_with_one_cleared_event() -> None:
    async with OffloadManager(_kv(7), _cfg()) as mgr:
        st = mgr.swap_out([0], [K[0]])
        await mgr.step()
        await st
        seen: list[KVEvent] = []

        async def consume() -> None:
            async for event in mgr.events():
                seen.append(event)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
    await asyncio.wait_for(task, timeout=10)
    assert seen == [KVEvent("stored", (K[0],)), KVEvent("cleared", (), "all")]
    assert mgr.take_events() == []


@pytest.mark.asyncio
async def test_a_store_waiting_for_room_keeps_a_copy_of_its_token_ids() -> None:
    engine = NullEngine(hold=True)
    cfg = _cfg(num_cpu_blocks=1, backpressure="wait", store_wait_s=30.0)
    async with OffloadManager(_kv(8), cfg, engine=engine) as mgr:
        # 1. K0 READY, then a load of it in flight: its block cannot be evicted
        st = mgr.swap_out([0], [K[0]])
        await mgr.step()
        engine.complete_next()
        await st
        load = mgr.swap_in([K[0]], [5])
        await mgr.step()
        mgr.take_events()
        # 2. a store of K1 with tokens waits for room; the caller reuses its buffer meanwhile
        tokens = _tokens(1, 9)
        original = tokens.copy()
        waiting = mgr.swap_out([1], [K[1]], token_ids=tokens)
        tokens[:] = 0
        # 3. the load ends: room; the store is queued, flushed, lands with the original tokens
        engine.release()
        await load
        await mgr.step()
        await waiting
        removed, stored = mgr.take_events()
        assert removed.keys == (K[0],) and stored.keys == (K[1],)
        np.testing.assert_array_equal(stored.token_ids, original)
