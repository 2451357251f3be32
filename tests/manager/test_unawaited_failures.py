"""A failed swap nobody awaits is not reported by asyncio as "exception was never retrieved"
(newuser12): the flush marks its futures retrieved (an unawaited failure is counted in the
statistics), and so must every other future kvmgr hands out: a store waiting for room that
times out or is failed by ``close``, a ``GroupedManager`` store or load, a
``DeepSeekV4Offload`` store. The caller who does await still gets the error."""

from __future__ import annotations

import asyncio
import gc
import hashlib
from typing import Any

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import PoolExhaustedError, TransferError
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches
from kvmgr.testing import FaultyEngine
from kvmgr.transfer.host import HostEngine


def _unretrieved() -> list[str]:
    """Install a handler on the running loop that records asyncio's complaints."""
    seen: list[str] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: seen.append(context["message"])
    )
    return seen


async def _collect() -> None:
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)


def _failing() -> FaultyEngine:
    return FaultyEngine(HostEngine(), fail_rate=1.0, seed=0)


@pytest.mark.asyncio
async def test_a_waiting_store_that_times_out_unawaited_is_not_logged() -> None:
    seen = _unretrieved()
    config = ManagerConfig(num_cpu_blocks=4, backpressure="wait", store_wait_s=0.01)
    async with OffloadManager([torch.zeros(16, 2, 4)], config) as mgr:
        ids = mgr.allocate("a", 8)
        first = mgr.swap_out(ids[:4], [bytes([i]) * 8 for i in range(4)])  # PENDING: no room
        waiting = mgr.swap_out(ids[4:], [bytes([i + 8]) * 8 for i in range(4)])
        await asyncio.sleep(0.05)  # the waiting store times out, nobody awaiting it
        assert isinstance(waiting.exception(), PoolExhaustedError)  # (this await: retrieved)
        waiting = mgr.swap_out(ids[4:], [bytes([i + 16]) * 8 for i in range(4)])
        del waiting
        await asyncio.sleep(0.05)
        await mgr.step()
        await first
    await _collect()
    assert seen == []


@pytest.mark.asyncio
async def test_a_waiting_store_failed_by_close_unawaited_is_not_logged() -> None:
    seen = _unretrieved()
    config = ManagerConfig(num_cpu_blocks=4, backpressure="wait", store_wait_s=10.0)
    mgr = OffloadManager([torch.zeros(16, 2, 4)], config)
    ids = mgr.allocate("a", 8)
    mgr.swap_out(ids[:4], [bytes([i]) * 8 for i in range(4)])
    mgr.swap_out(ids[4:], [bytes([i + 8]) * 8 for i in range(4)])  # waits; close fails it
    await mgr.aclose()
    await _collect()
    assert seen == []


def _grouped(engine: Any) -> GroupedManager:
    bs = 16
    layout = GroupedLayout(
        [GroupSpec(name="full", kind="full", block_size=bs, page_bytes=(bs * 8,))],
        hash_block_size=bs,
    )
    kv = [torch.zeros(8, bs * 8, dtype=torch.uint8)]
    config = ManagerConfig(num_cpu_blocks=8, engine="host", manage_gpu_blocks=False)
    return GroupedManager(layout, [OffloadManager(kv, config, engine=engine)])


@pytest.mark.asyncio
async def test_a_failed_grouped_store_unawaited_is_not_logged() -> None:
    seen = _unretrieved()
    hashes = [hashlib.blake2b(bytes([i])).digest() for i in range(2)]
    async with _grouped(_failing()) as mgr:
        mgr.store(hashes[:1], {"full": [0]})  # never awaited
        awaited = mgr.store(hashes[1:], {"full": [1]})
        await mgr.step()
        with pytest.raises(TransferError):  # an awaiting caller still gets the error
            await awaited
        await asyncio.sleep(0.05)
    await _collect()
    assert seen == []


@pytest.mark.asyncio
async def test_a_failed_grouped_load_unawaited_is_not_logged() -> None:
    seen = _unretrieved()
    engine = FaultyEngine(HostEngine(), fail_batches={1}, seed=0)  # the load's batch fails
    hashes = [hashlib.blake2b(b"k").digest()]
    async with _grouped(engine) as mgr:
        stored = mgr.store(hashes, {"full": [0]})
        await mgr.step()
        await stored
        mgr.load(mgr.lookup(hashes), {"full": [5]})  # never awaited
        await mgr.step()
        await asyncio.sleep(0.05)
        assert engine.statistics().batches_failed == 1
    await _collect()
    assert seen == []


@pytest.mark.asyncio
async def test_a_failed_deepseek_v4_store_unawaited_is_not_logged() -> None:
    seen = _unretrieved()
    layout = DeepSeekV4Layout(compress_ratios=(0, 4, 128), head_dim=128)
    n = 301
    need = {g.name: len(layout.blocks_at(g.name, n)) for g in layout.groups}
    caches = allocate_caches(layout, {g: 2 * k for g, k in need.items()})
    managers = {
        g: OffloadManager(
            caches[g],
            ManagerConfig(num_cpu_blocks=8, engine="host", manage_gpu_blocks=False),
            engine=_failing(),
        )
        for g in need
    }
    tables = {g: [-1] * layout.blocks_at(g, n).start + list(range(k)) for g, k in need.items()}
    async with DeepSeekV4Offload(layout, managers) as offload:
        offload.store(n, tables, [b"block-0"], b"request@301")  # never awaited
        await offload.step()
        await asyncio.sleep(0.05)
    await _collect()
    assert seen == []
