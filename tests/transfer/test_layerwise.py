"""Layerwise loads and stores on the host engine: bytes, layer order, events, failures, misuse."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import numpy as np
import pytest
import torch

from kvmgr import (
    ClosedError,
    LayerLoadError,
    LayerOrderError,
    ManagerConfig,
    OffloadManager,
    TransferError,
)
from kvmgr.testing import FaultyEngine, ScriptedEngine, check_invariants
from kvmgr.transfer.host import HostEngine
from kvmgr.transfer.layer_groups import LayerGroups
from kvmgr.transfer.plan import Direction

NUM_LAYERS = 4


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [hashlib.blake2b(bytes([salt, i])).digest() for i in range(n)]


def _caches(num_blocks: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # K and V per layer, never zeros
    return [torch.randn(num_blocks, 16, 8, generator=gen) for _ in range(2 * NUM_LAYERS)]


async def _store(mgr: OffloadManager, ids: object, keys: list[bytes]) -> None:
    future = mgr.store_many(ids, keys)
    await mgr.step()
    await future


def _manager(caches: list[torch.Tensor], engine: object = None) -> OffloadManager:
    config = ManagerConfig(num_cpu_blocks=64, policy="lru")
    return OffloadManager(caches, config, engine=engine)  # type: ignore[arg-type]


def _recording_engine() -> ScriptedEngine:
    """The host engine under the testing kit's scripted engine, recording every batch."""
    return ScriptedEngine(HostEngine(), record=True)


def _gpu_starts(engine: ScriptedEngine) -> list[tuple[Direction, int]]:
    """Each submitted plan's direction and first GPU tensor address, in order (an empty plan,
    which has no blocks, is left out)."""
    starts = []
    for plan, _, _ in engine.submitted:
        if plan.blocks is not None:
            gpu = plan.blocks.dst if plan.direction is Direction.H2D else plan.blocks.src
            starts.append((plan.direction, int(gpu.base_addrs[0])))
    return starts


def _event_engine(**script: object) -> ScriptedEngine:
    """The host engine under the scripted one, its handles carrying stand-in end events (the
    CUDA path of ``wait_layer``: a stream wait, no host wait; ``stream_waits`` records them)."""
    return ScriptedEngine(HostEngine(), end_events=True, **script)  # type: ignore[arg-type]


def test_groups_by_layer_and_size() -> None:
    pages = [100, 100, 100, 100, 100, 100]
    one = LayerGroups.build(pages, 2)
    assert one.num_layers == 3 and one.num_groups == 3
    assert [t.tolist() for t in one.tensors] == [[0, 1], [2, 3], [4, 5]]
    merged = LayerGroups.build(pages, 2, min_group_bytes=400)
    assert merged.group_of.tolist() == [0, 0, 1] and merged.group_bytes == (400, 200)
    explicit = LayerGroups.build([8, 8, 8], [0, 0, 1])
    assert explicit.group_of.tolist() == [0, 1] and explicit.last_layer(0) == 0
    for bad in ([0, 2, 2], [1, 1, 1], [0, 1], 4):
        with pytest.raises(LayerOrderError):
            LayerGroups.build([8, 8, 8], bad)
    with pytest.raises(LayerOrderError):
        LayerGroups.build([8], None, min_group_bytes=-1)
    capped = LayerGroups.build([100] * 8, 2, max_groups=2)  # 4 layers of 200 B: 400 B a group
    assert capped.group_of.tolist() == [0, 0, 1, 1]
    assert LayerGroups.build([100] * 8, 2, max_groups=3).num_groups == 2  # 267 B: 2 layers
    for bad in (0, True, 1.5):
        with pytest.raises(LayerOrderError):
            LayerGroups.build([8], None, max_groups=bad)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_round_trip_and_layer_order() -> None:
    caches = _caches()
    engine = _recording_engine()
    keys = _keys(6)
    async with _manager(caches, engine) as mgr:
        src = mgr.allocate("a", 6)
        store = mgr.store_layerwise(src, keys, layers=2)
        assert mgr.peek(keys) == 0  # PENDING until every layer landed
        for layer in range(NUM_LAYERS):
            store.save_layer(layer)
        stored = await store
        assert stored.stored.all() and store.done()
        dst = mgr.allocate("b", 6)
        load = mgr.load_layerwise(keys, dst, layers=2)
        for layer in range(NUM_LAYERS):
            load.wait_layer(layer)
            # the host engine blocks: this layer's K and V have landed, later ones may not have
            assert torch.equal(caches[2 * layer][src], caches[2 * layer][dst])
        result = await load
        assert result.gpu_block_ids.tolist() == list(dst)
        check_invariants(mgr)
    # one batch per layer, in layer order, each starting at the layer's K tensor
    k_addrs = [caches[2 * i].data_ptr() for i in range(NUM_LAYERS)]
    assert _gpu_starts(engine) == [(Direction.D2H, a) for a in k_addrs] + [
        (Direction.H2D, a) for a in k_addrs
    ]


@pytest.mark.asyncio
async def test_store_fences_each_layer_at_its_save() -> None:
    """A layer's bytes are copied as they were at its save_layer, not as at the end."""
    caches = _caches()
    keys = _keys(4, salt=1)
    async with _manager(caches) as mgr:
        blocks = mgr.allocate("a", 4)
        expected = []
        store = mgr.store_layerwise(blocks, keys, layers=2)
        for layer in range(NUM_LAYERS):
            for t in (2 * layer, 2 * layer + 1):
                caches[t][blocks] = torch.randn(4, 16, 8)  # the forward writes the layer's KV
            expected.append([caches[t][blocks].clone() for t in (2 * layer, 2 * layer + 1)])
            store.save_layer(layer)
        await store
        dst = mgr.allocate("b", 4)
        await mgr.load_layerwise(keys, dst, layers=2, min_group_bytes=1 << 30)
        for layer in range(NUM_LAYERS):
            for j, t in enumerate((2 * layer, 2 * layer + 1)):
                assert torch.equal(caches[t][dst], expected[layer][j])


@pytest.mark.asyncio
async def test_min_group_bytes_merges_layers() -> None:
    caches = _caches()
    engine = _event_engine()
    keys = _keys(3, salt=2)
    async with _manager(caches, engine) as mgr:
        a = mgr.allocate("a", 3)
        await _store(mgr, a, keys)
        page = caches[0][0].numel() * 4
        load = mgr.load_layerwise(keys, mgr.allocate("b", 3), layers=2, min_group_bytes=4 * page)
        assert load.groups.num_groups == 2 and len(load.batches.handles) == 2
        for layer in range(NUM_LAYERS):
            load.wait_layer(layer)
        first, second = (h.batch_id for h in load.batches.handles)
        # stream waits (not host waits) on the group's event; layers 0-1 share group 0, whose
        # wait is issued once on the stream; another stream needs its own wait
        assert engine.stream_waits == [first, second]
        load.wait_layer(NUM_LAYERS - 1)  # again: a no-op
        assert engine.stream_waits == [first, second]
        load.wait_layer(NUM_LAYERS - 1, stream="other")
        assert engine.stream_waits == [first, second, second]
        await load


@pytest.mark.asyncio
async def test_misuse_raises_typed_errors() -> None:
    caches = _caches()
    keys = _keys(2, salt=3)
    async with _manager(caches) as mgr:
        await _store(mgr, mgr.allocate("a", 2), keys)
        load = mgr.load_layerwise(keys, mgr.allocate("b", 2), layers=2)
        with pytest.raises(LayerOrderError, match="not scheduled"):
            load.wait_layer(NUM_LAYERS)
        with pytest.raises(LayerOrderError):
            load.wait_layer(-1)
        with pytest.raises(LayerOrderError):
            load.wait_layer(True)  # type: ignore[arg-type]
        load.wait_layer(2)
        load.wait_layer(2)  # again: a no-op
        with pytest.raises(LayerOrderError, match="layer order"):
            load.wait_layer(1)
        await load
        load.close()
        with pytest.raises(ClosedError):
            load.wait_layer(3)
        with pytest.raises(LayerOrderError):
            mgr.load_layerwise(keys, mgr.allocate("c", 2), layers=3)  # 8 tensors, not 3 per layer

        store = mgr.store_layerwise(mgr.allocate("d", 2), _keys(2, salt=4), layers=2)
        with pytest.raises(LayerOrderError, match="out of order"):
            store.save_layer(1)
        store.save_layer(0)
        with pytest.raises(LayerOrderError):
            store.save_layer(0)  # twice
        for layer in range(1, NUM_LAYERS):
            store.save_layer(layer)
        with pytest.raises(LayerOrderError, match="every layer"):
            store.save_layer(0)  # complete
        await store
        check_invariants(mgr)
    with pytest.raises(ClosedError):
        load.wait_layer(3)


@pytest.mark.asyncio
async def test_failed_layer_fails_the_whole_load() -> None:
    caches = _caches()
    keys = _keys(5, salt=5)
    faulty = FaultyEngine(HostEngine(), fail_batches={3})  # batch 0: the store; 1-4: layers
    async with _manager(caches, faulty) as mgr:
        a = mgr.allocate("a", 5)
        await _store(mgr, a, keys)
        b = mgr.allocate("b", 5)
        load = mgr.load_layerwise(keys, b, layers=2)
        with pytest.raises(LayerLoadError):
            await load
        # every wait now raises: no layer of a failed load may be read, not even layer 0
        with pytest.raises(LayerLoadError):
            load.wait_layer(0)
        check_invariants(mgr)
        assert mgr.peek(keys) == 5  # the CPU copies are intact and unpinned
        again = mgr.load_layerwise(keys, b, layers=2)
        for layer in range(NUM_LAYERS):
            again.wait_layer(layer)
        await again
        assert all(torch.equal(t[a], t[b]) for t in caches)


@pytest.mark.asyncio
async def test_refused_group_is_known_before_the_first_wait() -> None:
    caches = _caches()
    keys = _keys(2, salt=6)
    engine = _event_engine(refuse_issue_batches={4})  # batch 0: the store; 1-4: the layers
    async with _manager(caches, engine) as mgr:
        await _store(mgr, mgr.allocate("a", 2), keys)
        load = mgr.load_layerwise(keys, mgr.allocate("b", 2), layers=2)  # the last is refused
        with pytest.raises(LayerLoadError, match="refused"):
            load.wait_layer(0)
        assert engine.stream_waits == []  # no stream waited on a layer of the failed load
        with pytest.raises(LayerLoadError):
            await load
        check_invariants(mgr)

        faulty_keys = _keys(2, salt=7)
        await _store(mgr, mgr.allocate("c", 2), faulty_keys)
    refusing = FaultyEngine(HostEngine(), refuse_batches={2})
    async with _manager(_caches(), refusing) as mgr:
        await _store(mgr, mgr.allocate("a", 2), keys)
        load = mgr.load_layerwise(keys, mgr.allocate("b", 2), layers=2)
        assert len(load.batches.handles) == 1  # groups after the refused one are not submitted
        with pytest.raises(LayerLoadError):
            load.wait_layer(0)
        with pytest.raises(LayerLoadError, match="could not submit"):
            await load
        check_invariants(mgr)
        assert mgr.peek(keys) == 2


@pytest.mark.asyncio
async def test_layers_land_in_order_under_a_slow_copy() -> None:
    """Group 1 hangs: layer 0 is readable after its wait, layer 1's wait blocks until release."""
    caches = _caches()
    keys = _keys(3, salt=8)
    faulty = FaultyEngine(HostEngine(), hang_batches={2})  # batch 0: the store; 1: layer 0
    async with _manager(caches, faulty) as mgr:
        a = mgr.allocate("a", 3)
        await _store(mgr, a, keys)
        b = mgr.allocate("b", 3)
        load = mgr.load_layerwise(keys, b, layers=2)
        load.wait_layer(0)
        assert torch.equal(caches[0][a], caches[0][b])
        check_invariants(mgr)  # every unresolved group is known to the manager, blocks fenced
        returned = threading.Event()
        waiter = threading.Thread(target=lambda: (load.wait_layer(1), returned.set()))
        waiter.start()
        await asyncio.sleep(0.05)
        assert not returned.is_set()  # layer 1's copy has not run
        faulty.release()
        waiter.join(5)
        assert returned.is_set() and torch.equal(caches[2][a], caches[2][b])
        await load


@pytest.mark.asyncio
async def test_abort_and_close_fail_unsaved_stores() -> None:
    caches = _caches()
    keys = _keys(3, salt=9)
    mgr = _manager(caches)
    async with mgr:
        store = mgr.store_layerwise(mgr.allocate("a", 3), keys, layers=2)
        store.save_layer(0)
        check_invariants(mgr)  # a store half saved: PENDING keys, its blocks busy
        store.abort()
        store.save_layer(1)  # after abort: nothing more is copied, the forward goes on
        with pytest.raises(LayerLoadError, match="1 of 4"):
            await store
        assert mgr.peek(keys) == 0  # the keys of a failed store are dropped
        check_invariants(mgr)
        late = mgr.store_layerwise(mgr.allocate("b", 3), _keys(3, salt=10), layers=2)
        late.save_layer(0)
    # closing the manager failed the unfinished store instead of waiting for it
    with pytest.raises(LayerLoadError):
        await late
    with pytest.raises(ClosedError):
        late.save_layer(1)


@pytest.mark.asyncio
async def test_load_flushes_what_was_queued_first() -> None:
    caches = _caches()
    keys, queued = _keys(2, salt=11), _keys(2, salt=12)
    engine = _recording_engine()
    async with _manager(caches, engine) as mgr:
        a = mgr.allocate("a", 2)
        await _store(mgr, a, keys)
        stored = mgr.store_many(mgr.allocate("q", 2), queued)  # queued, not flushed
        del engine.submitted[:]
        load = mgr.load_layerwise(keys, mgr.allocate("b", 2), layers=2)
        assert [d for d, _ in _gpu_starts(engine)] == [Direction.D2H] + [Direction.H2D] * 4
        await asyncio.wait_for(stored, 5)  # submitted by the load's flush, without a step()
        await load
        empty = mgr.load_layerwise([], np.zeros(0, dtype=np.int64), layers=2)
        for layer in range(NUM_LAYERS):
            empty.wait_layer(layer)
        await empty
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_refused_store_layer_fails_the_store_not_the_forward() -> None:
    caches = _caches()
    keys = _keys(3, salt=13)
    engine = FaultyEngine(HostEngine(), refuse_batches={1})
    async with _manager(caches, engine) as mgr:
        store = mgr.store_layerwise(mgr.allocate("a", 3), keys, layers=2)
        for layer in range(NUM_LAYERS):
            store.save_layer(layer)  # layer 1 is refused; later layers are not copied, no raise
        assert len(store.batches.handles) == 1
        with pytest.raises(LayerLoadError, match="could not submit"):
            await store
        assert mgr.peek(keys) == 0
        check_invariants(mgr)


@pytest.mark.asyncio
async def test_group_layouts_are_made_once() -> None:
    """The copy kernel keeps one device table per layout pair, keyed by the layout objects: every
    load of the same groups must reuse the same sub-layouts."""
    caches = _caches()
    engine = _recording_engine()
    seen: list[tuple[object, object]] = []
    submit = engine.submit

    def recording(plan, *, wait_for=()):  # type: ignore[no-untyped-def]
        seen.append((plan.blocks.src, plan.blocks.dst))  # kept alive: no id reuse
        return submit(plan, wait_for=wait_for)

    engine.submit = recording  # type: ignore[method-assign]
    keys = _keys(2, salt=14)
    async with _manager(caches, engine) as mgr:
        await _store(mgr, mgr.allocate("a", 2), keys)
        del seen[:]
        for name in ("b", "c"):
            await mgr.load_layerwise(keys, mgr.allocate(name, 2), layers=2)
    assert len(seen) == 2 * NUM_LAYERS
    for (src_a, dst_a), (src_b, dst_b) in zip(seen[:NUM_LAYERS], seen[NUM_LAYERS:]):
        assert src_a is src_b and dst_a is dst_b


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [5, 1, 9, 2], [3, 4, 9, 10, 0]])
def test_group_plan_equals_build_plan_of_the_group(ids: list[int]) -> None:
    """A group's plan sliced from the whole operation's equals ``build_plan`` over the group's
    sub-layouts: same counts, same descriptors (dense and strided tensors, runs or none)."""
    from kvmgr.pool.layout import KVLayout
    from kvmgr.transfer.layer_groups import group_plan, sub_layout
    from kvmgr.transfer.plan import Direction, build_plan

    def layout(base: int, strides: list[int]) -> KVLayout:
        pages = np.array([64, 64, 128, 128], dtype=np.int64)
        bases = base + np.arange(4, dtype=np.int64) * (1 << 20)
        return KVLayout(bases, np.asarray(strides, dtype=np.int64), pages, 16, torch.device("cpu"))

    gpu = layout(1 << 30, [64, 96, 128, 128])  # tensor 1 strided: a descriptor per page
    cpu = layout(1 << 34, [64, 64, 128, 256])  # tensor 3 strided on this side
    src = np.asarray(ids, dtype=np.int64)
    dst = np.arange(len(ids), dtype=np.int64) + 2
    whole = build_plan(Direction.H2D, cpu, gpu, src, dst)
    for tensors in (np.array([0, 1]), np.array([2, 3]), np.array([1, 2, 3])):
        sub_cpu, sub_gpu = sub_layout(cpu, tensors), sub_layout(gpu, tensors)
        expected = build_plan(Direction.H2D, sub_cpu, sub_gpu, src, dst)
        got = group_plan(Direction.H2D, whole.blocks, sub_cpu, sub_gpu)
        assert (got.num_blocks, got.num_pages, got.num_bytes, got.num_descriptors) == (
            expected.num_blocks, expected.num_pages, expected.num_bytes, expected.num_descriptors
        )  # fmt: skip
        for a, b in zip(
            (got.src_addrs, got.dst_addrs, got.sizes),
            (expected.src_addrs, expected.dst_addrs, expected.sizes),
        ):
            assert np.array_equal(a, b)
    assert group_plan(Direction.H2D, None, cpu, gpu).num_descriptors == 0


async def _finish_and_read_back(
    mgr: OffloadManager,
    store: object,
    keys: list[bytes],
    caches: list[torch.Tensor],
    expected: list[torch.Tensor],
) -> None:
    """Save the store's other layers, then load its keys back: every layer holds ``expected``
    (the KV its blocks held when it started, not what a refused load would have written)."""
    for layer in range(1, NUM_LAYERS):
        store.save_layer(layer)  # type: ignore[attr-defined]
    await store  # type: ignore[misc]
    check_invariants(mgr)
    dst = mgr.allocate("d", len(keys))
    back = mgr.load_many(keys, dst)
    await mgr.step()
    await back
    assert len(caches) == len(expected) > 0
    for t, want in zip(caches, expected):
        assert torch.equal(t[dst], want)


@pytest.mark.asyncio
async def test_a_load_into_an_open_layerwise_stores_blocks_fails_on_the_host_engine() -> None:
    """The host engine's FIFO thread does not order a batch after layers not yet saved: a load
    queued into the blocks of a store that saved layer 0 only fails at ``step()`` (as on the CUDA
    engines) instead of overwriting KV the later layers have yet to store (new user, round 4)."""
    caches = _caches()
    async with _manager(caches) as mgr:
        old = _keys(4, salt=1)
        await _store(mgr, mgr.allocate("old", 4), old)
        src = np.asarray(mgr.allocate("s", 4))
        expected = [t[torch.from_numpy(src)].clone() for t in caches]
        keys = _keys(4)
        store = mgr.store_layerwise(src, keys, layers=2)
        store.save_layer(0)
        load = mgr.load_many(old, src)  # into the blocks the store has yet to read
        await mgr.step()  # the step itself does not raise
        with pytest.raises(TransferError, match="layerwise store"):
            await load
        await _finish_and_read_back(mgr, store, keys, caches, expected)


@pytest.mark.asyncio
async def test_a_layerwise_load_into_an_open_layerwise_stores_blocks_is_refused() -> None:
    """``load_layerwise`` into the blocks of a store that saved layer 0 only is refused as a
    whole (``LayerLoadError``, typed) instead of running at once on the host engine: the store
    keeps every layer of the KV it was asked to store (new user, round 4)."""
    caches = _caches()
    async with _manager(caches) as mgr:
        old = _keys(4, salt=1)
        await _store(mgr, mgr.allocate("old", 4), old)
        src = mgr.allocate("s", 4)
        expected = [t[src].clone() for t in caches]
        keys = _keys(4)
        store = mgr.store_layerwise(src, keys, layers=2)
        store.save_layer(0)
        load = mgr.load_layerwise(old, src, layers=2)
        with pytest.raises(LayerLoadError, match="layerwise store"):
            load.wait_layer(0)
        with pytest.raises(LayerLoadError):
            await load
        await _finish_and_read_back(mgr, store, keys, caches, expected)
