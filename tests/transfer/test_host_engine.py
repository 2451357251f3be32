"""HostEngine: real copies off the caller's thread, FIFO completion, statistics, close; make_engine."""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvmgr.errors import ClosedError, ConfigError, GeometryError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import HostEngine, make_engine
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan


def _plan(
    direction: Direction,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_ids: Any,
    dst_ids: Any,
) -> TransferPlan:
    """``build_plan`` between the layouts of ``src`` and ``dst`` (ids: sequences or arrays)."""
    layouts = KVLayout.from_tensors(src), KVLayout.from_tensors(dst)
    return build_plan(direction, *layouts, np.asarray(src_ids), np.asarray(dst_ids))


@pytest.fixture
def engine() -> HostEngine:
    eng = HostEngine()
    yield eng
    eng.close()


def _pair(seed: int, nb: int = 6) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    gpu = [
        torch.randint(1, 256, (nb, 584), dtype=torch.uint8, generator=gen),
        torch.randn(nb, 2, 288, generator=gen).to(torch.bfloat16),
    ]
    cpu = [
        torch.full((nb, 584), 0xA5, dtype=torch.uint8),
        torch.full((nb, 1152), 0xA5, dtype=torch.uint8),
    ]
    return gpu, cpu


def _page(t: torch.Tensor, b: int) -> bytes:
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def test_allocate_host_gives_a_cpu_byte_tensor(engine: HostEngine) -> None:
    region = engine.allocate_host(1000)
    assert (region.dtype, region.numel(), region.device.type) == (torch.uint8, 1000, "cpu")


def test_submit_copies_the_pages_and_reports_the_batch(engine: HostEngine) -> None:
    gpu, cpu = _pair(seed=1)
    plan = _plan(Direction.D2H, gpu, cpu, [4, 0, 1], [2, 3, 4])
    handle = engine.submit(plan)
    result = handle.future.result(timeout=10)
    assert handle.done() and handle.direction is Direction.D2H
    assert (result.batch_id, result.direction, result.path) == (0, Direction.D2H, "host")
    assert result.num_bytes == 3 * (584 + 1152) == plan.num_bytes
    assert result.num_descriptors == plan.num_descriptors == 4  # 0-1 -> 3-4 merged per tensor
    assert result.device_s is not None and result.device_s >= 0
    for s, d in [(4, 2), (0, 3), (1, 4)]:
        assert _page(cpu[0], d) == _page(gpu[0], s)
        assert _page(cpu[1], d) == _page(gpu[1], s)
    untouched = bytes([0xA5]) * 584
    assert _page(cpu[0], 0) == untouched and _page(cpu[0], 1) == untouched


def test_batches_complete_in_submission_order_and_statistics_add_up(engine: HostEngine) -> None:
    gpu, cpu = _pair(seed=2)
    g, c = KVLayout.from_tensors(gpu), KVLayout.from_tensors(cpu)
    done_order: list[int] = []
    lock = threading.Lock()
    handles = []
    for i in range(6):
        direction = Direction.D2H if i % 2 == 0 else Direction.H2D
        src, dst = (g, c) if direction is Direction.D2H else (c, g)
        plan = build_plan(direction, src, dst, np.array([i]), np.array([5 - i]))
        handle = engine.submit(plan, wait_for=handles[-1:])
        handle.future.add_done_callback(
            lambda f, i=i: (lock.acquire(), done_order.append(i), lock.release())
        )
        handles.append(handle)
    results = [h.future.result(timeout=10) for h in handles]
    assert [r.batch_id for r in results] == list(range(6))
    assert done_order == list(range(6))
    stats = engine.statistics()
    block = 584 + 1152
    assert (stats.batches_submitted, stats.batches_completed, stats.batches_failed) == (6, 6, 0)
    assert (stats.bytes_d2h, stats.bytes_h2d, stats.in_flight) == (3 * block, 3 * block, 0)
    assert stats.path == "host"


def test_h2d_then_d2h_of_the_same_block_reads_the_new_bytes(engine: HostEngine) -> None:
    # FIFO on one worker: a store submitted after a load of the same GPU block sees the load
    gpu, cpu = _pair(seed=3)
    g, c = KVLayout.from_tensors(gpu), KVLayout.from_tensors(cpu)
    cpu[0][1].copy_(torch.arange(584) % 251 + 1)
    load = engine.submit(build_plan(Direction.H2D, c, g, np.array([1]), np.array([0])))
    store = engine.submit(
        build_plan(Direction.D2H, g, c, np.array([0]), np.array([5])), wait_for=[load]
    )
    store.future.result(timeout=10)
    assert _page(cpu[0], 5) == _page(cpu[0], 1) == _page(gpu[0], 0)


def test_close_is_idempotent_and_submit_after_close_raises() -> None:
    eng = HostEngine()
    gpu, cpu = _pair(seed=4)
    plan = _plan(Direction.D2H, gpu, cpu, [0], [0])
    handle = eng.submit(plan)
    eng.close()
    assert handle.done()  # close waited for the batch in flight
    eng.close(timeout_s=0.1)
    with pytest.raises(ClosedError):
        eng.submit(plan)
    assert eng.statistics().batches_submitted == 1


def test_stream_wait_is_a_no_op(engine: HostEngine) -> None:
    gpu, cpu = _pair(seed=5)
    plan = _plan(Direction.H2D, cpu, gpu, [0], [0])
    handle = engine.submit(plan)
    handle.future.result(timeout=10)
    engine.stream_wait(handle)


def test_make_engine_by_name() -> None:
    eng = make_engine("host", torch.device("cpu"))
    try:
        assert isinstance(eng, HostEngine) and eng.name == "host"
    finally:
        eng.close()
    eng = make_engine("auto", torch.device("cpu"))
    try:
        assert isinstance(eng, HostEngine)
    finally:
        eng.close()


def test_make_engine_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make_engine("dma", torch.device("cpu"))
    for name in ("host", "cuda", "kernel", "auto"):
        assert name in str(info.value)


@pytest.mark.parametrize(("name", "device"), [("host", "cuda"), ("cuda", "cpu"), ("kernel", "cpu")])
def test_make_engine_rejects_the_wrong_device(name: str, device: str) -> None:
    with pytest.raises(GeometryError):
        make_engine(name, torch.device(device))


def _strided_pair(seed: int, nb: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random source tensors (one with padding between blocks: not dense) and poisoned
    destination views of one region, with a poisoned margin after the last tensor."""
    gen = torch.Generator().manual_seed(seed)
    padded = torch.randint(0, 256, (nb, 640), dtype=torch.uint8, generator=gen)
    src = [torch.randint(0, 256, (nb, 576), dtype=torch.uint8, generator=gen), padded[:, :584]]
    region = torch.full((2 * nb * (576 + 584) + 64,), 0xA5, dtype=torch.uint8)
    dst = [
        region[: 2 * nb * 576].view(2 * nb, 576),
        region[2 * nb * 576 : 2 * nb * (576 + 584)].view(2 * nb, 584),
    ]
    return src, dst


@pytest.mark.parametrize("num_blocks", [1, 7, 64, 200])
def test_scattered_plans_copy_exactly_their_pages(engine: HostEngine, num_blocks: int) -> None:
    # many scattered pages: the bulk path (one gather and scatter per tensor, in chunks)
    rng = np.random.default_rng(num_blocks)
    src, dst = _strided_pair(num_blocks, 256)
    src_ids = rng.choice(256, num_blocks, replace=False)
    dst_ids = rng.choice(512, num_blocks, replace=False)
    plan = _plan(Direction.H2D, src, dst, src_ids, dst_ids)
    before = [t.clone() for t in dst]
    engine.submit(plan).future.result(timeout=10)
    for s, d, old in zip(src, dst, before):
        expected = old.clone()
        expected[torch.from_numpy(dst_ids)] = s[torch.from_numpy(src_ids)]
        assert torch.equal(d, expected)  # the named pages, nothing else
    tail = bytes(dst[0].untyped_storage())[-64:]  # the margin after the last tensor
    assert tail == bytes([0xA5]) * 64


def test_an_edited_plan_is_copied_from_its_descriptors(engine: HostEngine) -> None:
    # a plan whose descriptors no longer match its block pairs (8 bytes short per page)
    import attrs

    rng = np.random.default_rng(3)
    src, dst = _strided_pair(3, 64)
    ids = rng.choice(64, 40, replace=False)
    layouts = KVLayout.from_tensors(src), KVLayout.from_tensors(dst)
    plan = build_plan(Direction.D2H, *layouts, ids, ids, merge=False)  # a descriptor per page
    short = attrs.evolve(plan, sizes=plan.sizes - 8)
    assert plan.matching_blocks() is not None and short.matching_blocks() is None
    engine.submit(short).future.result(timeout=10)
    index = torch.from_numpy(ids)
    for s, d in zip(src, dst):
        assert torch.equal(d[index, :-8], s[index, :-8])
        assert bool((d[index, -8:] == 0xA5).all())


def test_edited_addresses_are_honoured_even_when_the_counts_still_match(engine: HostEngine) -> None:
    # found by a fresh-user pass: with the same byte and descriptor counts, the host engine used
    # to copy the original block pairs (into A) instead of the edited destinations (into B)
    rng = np.random.default_rng(5)
    src, a = _strided_pair(6, 64)
    b = [t.clone() for t in a]
    before_a = [t.clone() for t in a]
    ids = rng.choice(64, 40, replace=False)
    plan = build_plan(Direction.D2H, KVLayout.from_tensors(src), KVLayout.from_tensors(a), ids, ids, merge=False)  # fmt: skip
    shift = np.repeat([tb.data_ptr() - ta.data_ptr() for ta, tb in zip(a, b)], len(ids))
    moved = attrs.evolve(plan, dst_addrs=plan.dst_addrs + shift)
    assert moved.num_bytes == plan.num_bytes and moved.num_descriptors == plan.num_descriptors
    assert moved.matching_blocks() is None
    engine.submit(moved).future.result(timeout=10)
    index = torch.from_numpy(ids)
    for s, ta, tb, ta0 in zip(src, a, b, before_a):
        assert torch.equal(tb[index], s[index])
        assert torch.equal(ta, ta0)  # A untouched


def test_a_plan_over_device_tensors_is_refused_before_any_copy(engine: HostEngine) -> None:
    gpu, cpu = _pair(seed=4)
    layout = KVLayout.from_tensors(gpu)
    on_device = attrs.evolve(layout, device=torch.device("cuda", 0))  # as a CUDA cache would be
    plan = build_plan(Direction.D2H, on_device, KVLayout.from_tensors(cpu), [0], [1])
    with pytest.raises(GeometryError, match="CPU tensors"):
        engine.submit(plan)
    assert engine.statistics().batches_submitted == 0
